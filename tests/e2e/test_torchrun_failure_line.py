"""torchrun as `dsv4 node start` runs it (runtime.launch.torchrun) says a failed rank in one line —
which rank, its host, pid and exit status or signal — where torchrun printed a traceback and a
footer (`traceback : To enable traceback see: …`); the node supervisor reads the rank's reason from
there (issue 71, item 1)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from conftest import REPO

WORKER = """\
import os, signal, sys, time
if os.environ["RANK"] == "1":
    print("2026-01-05 14:02:33.120 ERROR service rank 1 stopping: its own reason", file=sys.stderr, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
time.sleep(30)
"""


@pytest.mark.parametrize(("how", "said"), [("kill", "killed by SIGKILL"), ("exit", "exited 3")])
def test_a_failed_rank_is_one_line_naming_it_and_no_traceback(tmp_path, how, said):
    from console.cli.node import node_reason

    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "runtime.launch.torchrun", "--nnodes", "1", "--nproc-per-node", "2",
                           "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(port), str(worker),
                           how], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.startswith("torchrun: ")]
    assert len(lines) == 1 and lines[0].startswith(f"torchrun: rank 1 on {socket.gethostname()} (pid ")
    assert lines[0].split(") ", 1)[1].startswith(said)
    assert "Traceback" not in done.stderr and "To enable traceback" not in done.stderr
    log = tmp_path / "node.log"
    log.write_text(done.stdout + done.stderr)
    reason = node_reason(str(log))
    assert reason == (lines[0].removeprefix("torchrun: ") if how == "kill" else "rank 1 stopping: its own reason")
