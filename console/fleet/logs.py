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


def feeds(hosts: Mapping[str, Host], fleet_snapshot, host: str, *, view: ServiceView | None = None,
          pid: int | None = None, rank: int | None = None, follow: bool = True) -> list[LogFeed]:
    """The logs of the service on `host` (`view`, or the one `pid` names, or the newest): its own,
    then each rank's (`rank`: that one only). A host with no service: its node's log."""
    readings: Sequence = fleet_snapshot.hosts
    reading = fleet_snapshot.reading(host)
    snap = reading.snapshot if reading is not None else None
    view = view or service_on(snap, pid)
    h = hosts[host]
    if view is None:
        node = _node_of(readings, host)
        if node is None:
            raise UserError(f"{host}: no service and no node there to read a log of")
        return [h.log(f"node {node.node.node_rank}", node=node.node.pid, follow=follow)]
    out = [] if rank is not None else [h.log("service", pid=view.pid, follow=follow)]
    here = view.record.host or (snap.hostname if snap is not None else "")  # what the service's own host calls itself
    ranks = [r.rank for r in view.ranks] or list(range(len(view.record.rank_logs)))
    for r in ranks if rank is None else [rank]:
        health = next((x for x in view.ranks if x.rank == r), None)
        where = health.host if health is not None and health.host else here
        if where == here and r < len(view.record.rank_logs) and view.record.rank_logs[r]:
            out.append(h.log(f"rank {r}", pid=view.pid, rank=r, follow=follow))
            continue
        other = _host_named(readings, where)
        node = _node_of(readings, other) if other is not None else None
        if other is not None and other != host and node is not None:
            out.append(hosts[other].log(f"rank {r} on {other}", node=node.node.pid, follow=follow))
        elif rank is not None:
            raise UserError(f"rank {r} of pid {view.pid} runs on {where or 'an unknown host'}, whose log this fleet "
                            f"cannot reach")
    return out
