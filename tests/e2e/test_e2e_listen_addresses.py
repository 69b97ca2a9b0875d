"""Between hosts, only what the operator named listens (issue 68, item 6): a service of two ranks
(its launcher's rendezvous store, rank 0's HTTP, each rank's process group) and torchrun's agent
on node 0 (`runtime.launch.torchrun`) listen on the named address alone, never on every
interface (`0.0.0.0`, `::`), which a TCPStore and torchrun left to themselves do."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import psutil
import pytest
from conftest import start_server

from runtime.launch.rank_store import own_address

pytestmark = pytest.mark.slow


def _listening(root: int) -> set[tuple[int, str, int]]:
    tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    out = set()
    for p in tree:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                out.add((p.pid, c.laddr.ip, c.laddr.port))
    return out


def test_a_two_rank_service_listens_on_its_address_alone(tiny_ckpt_ro, tmp_path):
    proc, url, _ = start_server(tiny_ckpt_ro, tmp_path, "--backend", "eager", "--ranks", "2", "--validate-tokens", "1")
    try:
        sockets = _listening(proc.pid)
        ranks = [p.pid for p in psutil.Process(proc.pid).children(recursive=True) if "serve" in " ".join(p.cmdline())]
        assert {ip for _, ip, _ in sockets} == {"127.0.0.1"}, sockets
        assert any(pid == proc.pid for pid, _, _ in sockets)  # the launcher's store
        assert all(any(pid == r for pid, _, _ in sockets) for r in ranks)  # each rank's gloo (rank 0: HTTP too)
        assert int(url.rsplit(":", 1)[1]) in {port for _, _, port in sockets}
    finally:
        proc.terminate()
        proc.wait(60)


PROBE = textwrap.dedent("""
    import os, psutil, time
    agent = psutil.Process(os.getppid())
    found = {(c.laddr.ip, c.laddr.port) for c in agent.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
    print("LISTEN", sorted(found), flush=True)
""")


def test_torchruns_store_on_node_0_listens_on_the_master_address_alone(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "runtime.launch.torchrun", "--nnodes", "1", "--nproc-per-node", "1",
                          "--node-rank", "0", "--master-addr", "127.0.0.2", "--master-port", str(port),
                          str(tmp_path / "probe.py")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("LISTEN"))
    assert line == f"LISTEN [('127.0.0.2', {port})]"


def test_a_ranks_own_address_is_the_loopback_master_or_its_route_to_it():
    assert own_address("127.0.0.2") == "127.0.0.2"
    assert own_address("localhost") in ("127.0.0.1", "::1")
