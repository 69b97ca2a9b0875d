"""Hosts on this one machine, for tests of a service across hosts: the test bed is
`bench/ns_hosts.py` (mount + UTS namespaces, each host its own checkpoint copy, kernel cache,
state and keys at one shared path), which `dsv4 bench hosts` runs on too."""

from __future__ import annotations

from conftest import MAX_SEQ

from bench import ns_hosts
from bench.ns_hosts import Host, free_port, hosts, namespaces_work, stop, trust_each_other  # noqa: F401

assert ns_hosts.MAX_SEQ == MAX_SEQ  # a host's ranks serve with the tests' KV size


def store_groups(world: int = 2, names: list[str] | None = None):
    """`world` joined ranks on one real rendezvous store (no process group), rank r on
    `names[r]` (default host-a, host-b, …): (the store's host, the groups)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    from runtime.launch.rank_store import RankEnv
    from runtime.launch.ranks import Group

    port = free_port()
    host = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=5), wait_for_workers=False)
    groups = []
    for r in range(world):
        env = RankEnv(r, world, r, world, "127.0.0.1", port, False)
        g = Group(env, TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5), wait_for_workers=False), 1.0)
        g.hosts = list(names) if names else [f"host-{'abcdefgh'[i]}" for i in range(world)]
        groups.append(g)
    return host, groups
