"""Which log file of this host a console may follow: a service's (by its pid, or the newest
running one's), one of its ranks', or a service node's — only files the registries name
(`store.services`, `store.nodes`), never a path someone typed. Torch-free."""

from __future__ import annotations

from store.errors import UserError


def which_log(pid: int | None = None, rank: int | None = None, node: int | None = None) -> tuple[str, str]:
    """(label, path) of the log asked for; a UserError naming what is missing."""
    from store import nodes, services

    if node is not None:
        found = next((n for n in nodes.nodes() if n.pid == node), None)
        if found is None or not found.log:
            raise UserError(f"no node of this host has agent pid {node} (`dsv4 node ls`)")
        return f"node {found.node_rank}", found.log
    every = services.services()
    if pid is None:
        live = [s for s in every if not s.ended] or every
        if not live:
            raise UserError("no service on this host (`dsv4 service ls`)")
        service = live[-1] if not live[-1].ended else live[0]
    else:
        service = next((s for s in every if s.pid == pid), None)
        if service is None:
            raise UserError(f"no service of this host has pid {pid} (`dsv4 service ls`)")
    if rank is None:
        if not service.log:
            raise UserError(f"pid {service.pid} writes no log file (started from a terminal)")
        return "service", service.log
    if not 0 <= rank < len(service.rank_logs) or not service.rank_logs[rank]:
        raise UserError(f"pid {service.pid} keeps no log of rank {rank} here (ranks across hosts: each host's "
                        f"node log)")
    return f"rank {rank}", service.rank_logs[rank]


def log_args(pid: int | None = None, rank: int | None = None, node: int | None = None) -> tuple[str, ...]:
    """`which_log`'s question as `dsv4 service log` flags (what another host is asked)."""
    return (*(("--pid", str(pid)) if pid is not None else ()), *(("--rank", str(rank)) if rank is not None else ()),
            *(("--node", str(node)) if node is not None else ()))
