"""A service's logs across its hosts: its own log on the host it runs from, and each rank's on
whichever host that rank runs — a rank of this host by the log its launcher keeps, a rank on
another host of the fleet by that host's node log — each read over that host's own connection
(`Host.log`). Torch-free, no Textual."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from console.data.services import ServiceView
from console.fleet.host import Host, LogFeed
from store.errors import UserError


def service_on(snap, pid: int | None = None) -> ServiceView | None:
    """The service of a host's snapshot: by pid, else the newest running, else the last ended."""
    views = snap.services.services if snap is not None else ()
    if pid is not None:
        return next((v for v in views if v.pid == pid), None)
    live = [v for v in views if not v.ended]
    return live[-1] if live else (views[0] if views else None)


def _host_named(readings, hostname: str) -> str | None:
    """The fleet's name of the host that calls itself `hostname`."""
    return next((r.host for r in readings if r.snapshot is not None and r.snapshot.hostname == hostname), None)


def _node_of(readings, name: str):
    r = next((r for r in readings if r.host == name), None)
    nodes = r.snapshot.nodes if r is not None and r.snapshot is not None else ()
    return next((n for n in nodes if n.running), nodes[0] if nodes else None)


def _feed(h: Host, label: str, follow: bool, **where) -> LogFeed:
    """`h`'s log `where` says, which knows how to open the previous run's of the same (`p`)."""
    feed = h.log(label, follow=follow, **where)
    feed.earlier = lambda: h.log(f"{label}, previous run", follow=False, previous=True, **where)
    return feed


def feeds(hosts: Mapping[str, Host], fleet_snapshot, host: str, *, view: ServiceView | None = None,
          pid: int | None = None, rank: int | None = None, follow: bool = True) -> list[LogFeed]:
    """The logs of the service on `host` (`view`, or the one `pid` names, or the newest): its own,
    then each rank's own (`rank`: that one only), a rank on another host of the fleet read there,
    from that host's node. A host with no service: its node's log."""
    readings: Sequence = fleet_snapshot.hosts
    reading = fleet_snapshot.reading(host)
    snap = reading.snapshot if reading is not None else None
    view = view or service_on(snap, pid)
    h = hosts[host]
    if view is None:
        node = _node_of(readings, host)
        if node is None:
            raise UserError(f"{host}: no service and no node there to read a log of")
        return [_feed(h, f"node {node.node.node_rank}", follow, node=node.node.pid)]
    out = [] if rank is not None else [_feed(h, "service", follow, pid=view.pid)]
    here = view.record.host or (snap.hostname if snap is not None else "")  # what the service's own host calls itself
    kept = dict(view.logs())
    ranks = [r.rank for r in view.ranks] or [int(k.split()[1]) for k in kept if k.startswith("rank ")]
    for r in ranks if rank is None else [rank]:
        health = next((x for x in view.ranks if x.rank == r), None)
        where = health.host if health is not None and health.host else here
        if where == here and f"rank {r}" in kept:
            out.append(_feed(h, f"rank {r}", follow, pid=view.pid, rank=r))
            continue
        other = _host_named(readings, where)
        node = _node_of(readings, other) if other is not None else None
        if other is not None and other != host and node is not None:
            # its own log among its node's (`serve-PORT.rankR.log`), over that host's connection; a node
            # of an older dsv4 keeps none apart: torchrun's log, every rank of that host in it
            own = {"rank": r} if node.node.service_logs else {}
            out.append(_feed(hosts[other], f"rank {r} on {other}", follow, node=node.node.pid, **own))
        elif rank is not None:
            raise UserError(f"rank {r} of pid {view.pid} runs on {where or 'an unknown host'}, whose log this fleet "
                            f"cannot reach")
    return out
