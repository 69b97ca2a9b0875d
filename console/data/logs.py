"""Which log file of this host a console may follow: a service's (by its pid, or the newest
running one's), one of its ranks', or a service node's — and the previous run's of each — only
files the registries name (`store.services`, `store.nodes`) or their kept previous run beside
them (`store.logs.previous_of`), never a path someone typed. Torch-free.

A service's log is its own capped, rotated file (`log_file`: of several ranks, rank 0's; each
rank's in `rank_log_files`), what `dsv4 serve` writes besides stderr (runtime.log); a
service that keeps none (an older dsv4) has its output file (`log`, `rank_logs`). A node's is
torchrun's; a node's rank has its own, among the node's `service_logs`.
"""

from __future__ import annotations

import re
from pathlib import Path

from store.errors import UserError


def _previous(path: str, whose: str) -> str:
    """The previous run's log kept beside `path` (`serve-8000.prev.log`)."""
    from store.logs import previous_of

    kept = previous_of(Path(path)) if path else None
    if kept is None or not kept.is_file():
        raise UserError(f"{whose} has no previous run's log here (the first run in its log's slot)")
    return str(kept)


def _rank_of_node(node, rank: int) -> str:
    """Rank `rank`'s own log among a node's (`serve-PORT.rankR.log`)."""
    mark = re.compile(rf"\.rank{rank}\.[^/]*$")
    found = next((p for p in node.service_logs if mark.search(p)), "")
    if not found:
        raise UserError(f"node {node.node_rank} (agent pid {node.pid}) keeps no log of rank {rank} on this host")
    return found


def which_log(pid: int | None = None, rank: int | None = None, node: int | None = None,
              previous: bool = False) -> tuple[str, str]:
    """(label, path) of the log asked for (`previous`: the previous run's, kept beside it); a
    UserError naming what is missing."""
    from store import nodes, services

    later = " (previous run)" if previous else ""
    if node is not None:
        found = next((n for n in nodes.nodes() if n.pid == node), None)
        if found is None:
            raise UserError(f"no node of this host has agent pid {node} (`dsv4 node ls`)")
        if rank is not None:
            own = _rank_of_node(found, rank)
            return f"rank {rank}{later}", _previous(own, f"rank {rank}") if previous else own
        if previous:
            if not found.previous_log:
                raise UserError(f"node {found.node_rank} is the first node on this host: no previous node's log")
            return f"node {found.node_rank}{later}", found.previous_log
        if not found.log:
            raise UserError(f"node {found.node_rank} (agent pid {node}) keeps no log")
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
        own = service.log_file or service.log
        if previous:
            if service.previous_log:
                return f"service{later}", service.previous_log
            return f"service{later}", _previous(own, f"pid {service.pid}")
        if not own:
            raise UserError(f"pid {service.pid} writes no log file (started from a terminal)")
        return "service", own
    logs = service.rank_log_files if rank < len(service.rank_log_files) and service.rank_log_files[rank] \
        else service.rank_logs
    if not 0 <= rank < len(logs) or not logs[rank]:
        raise UserError(f"pid {service.pid} keeps no log of rank {rank} here (ranks across hosts: each host's "
                        f"node keeps its ranks' logs)")
    return f"rank {rank}{later}", _previous(logs[rank], f"rank {rank}") if previous else logs[rank]


def log_args(pid: int | None = None, rank: int | None = None, node: int | None = None,
             previous: bool = False) -> tuple[str, ...]:
    """`which_log`'s question as `dsv4 service log` flags (what another host is asked)."""
    return (*(("--pid", str(pid)) if pid is not None else ()), *(("--rank", str(rank)) if rank is not None else ()),
            *(("--node", str(node)) if node is not None else ()), *(("--previous",) if previous else ()))
