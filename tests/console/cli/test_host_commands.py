"""The `dsv4` commands a host runs for a console (on itself, or asked over ssh): its snapshot,
streamed per request; a node that cannot start, in one line; a log followed by the registry's
name for it, never a path someone typed."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from console.data.snapshot import SCHEMA_VERSION

REPO = Path(__file__).resolve().parents[3]


def _dsv4(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "console.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120, **kw)


def test_dsv4_snapshot_streams_one_line_per_request_and_ends_with_its_stdin(tiny_ckpt_ro):
    proc = subprocess.Popen([sys.executable, "-m", "console.cli", "snapshot", "--stream", "--model", str(tiny_ckpt_ro),
                             "--ranks", "2", "--local-ranks", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO)
    first = json.loads(proc.stdout.readline())
    proc.stdin.write(b"history\n")
    proc.stdin.flush()
    second = json.loads(proc.stdout.readline())
    proc.stdin.close()
    assert proc.wait(60) == 0
    assert first["v"] == second["v"] == SCHEMA_VERSION and second["ts"] > first["ts"]
    assert "torch" not in first["settings"]  # a snapshot, not a launch
    assert first["plan"]["kv"]["ranks"] == 1 and len(first["device"]["budgets"]) == 1  # this host's rank only
    assert first["settings"]["ranks"] == 2  # of a service of two


@pytest.mark.parametrize(("args", "says"), [
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "a", "--master-port", "1"], "the node rank must be 0..1"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "a", "--master-port", "0"], "node 0's to resolve"),
    (["--nnodes", "2", "--node-rank", "1", "--master-addr", "auto", "--master-port", "5"], "node 0's to resolve"),
    (["--nnodes", "2", "--node-rank", "0", "--master-addr", "203.0.113.9", "--master-port", "0"],
     "cannot bind a port there"),
])
def test_a_node_that_cannot_start_is_one_line_and_nothing_runs(tiny_ckpt_ro, args, says):
    done = _dsv4("node", "start", str(tiny_ckpt_ro), *args)
    assert done.returncode == 1 and says in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert json.loads(_dsv4("node", "ls", "--json").stdout) == []


def test_a_nodes_log_is_followed_by_its_record_and_an_unknown_one_is_one_line(tmp_path):
    from store import nodes

    log = tmp_path / "node.log"
    log.write_text("".join(f"line {i}\n" for i in range(10)))
    nodes.write(nodes.Node(4242, 1.0, 1, 2, "10.0.0.1:29500", "/m", str(log), "", 1, time.time()))
    done = _dsv4("service", "log", "--node", "4242")
    assert done.returncode == 0 and done.stdout.splitlines() == [f"line {i}" for i in range(10)]
    assert done.stderr.strip() == f"following {log}"
    follow = subprocess.Popen([sys.executable, "-m", "console.cli", "service", "log", "--node", "4242", "--follow"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=REPO, text=True)
    try:
        assert [follow.stdout.readline() for _ in range(10)][-1] == "line 9\n"
        with open(log, "a") as f:
            f.write("written later\n")
        assert follow.stdout.readline() == "written later\n"  # as it is written
    finally:
        follow.kill()
        follow.wait()
    missing = _dsv4("service", "log", "--node", "1")
    assert missing.returncode == 1 and missing.stderr.strip() == \
        "dsv4 service: no node of this host has agent pid 1 (`dsv4 node ls`)"
    nobody = _dsv4("service", "log")
    assert nobody.returncode == 1 and "no service on this host" in nobody.stderr
