"""`dsv4 service supervise`, the supervisor `dsv4 service start` leaves beside a detached service:
it records how the service ended where the service could not say so itself — a SIGKILL as
`killed by SIGKILL during serve` (its one history record `killed`, a `failed` event in this
host's timeline), a stop passed on to it as a stop — and leaves the service's own words alone
(real processes, an announcing stand-in for `dsv4 serve`, no torch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
from conftest import REPO

from store import services
from store import timeline as T
from store.history import read_history

ANNOUNCE = ("import sys, time; from store.services import Announcement; a = Announcement('/models/m'); "
            "a.serving('http://127.0.0.1:9'); {said} time.sleep(600)")


def _supervised(tmp_path, said: str = "", stamp: str = "1") -> tuple[subprocess.Popen, int]:
    """The supervisor of an announcing stand-in for `dsv4 serve`, and that stand-in's pid."""
    log = tmp_path / "serve.log"
    handoff = tmp_path / f"serve-{stamp}.start.json"
    handoff.write_text(json.dumps({"argv": [sys.executable, "-c", ANNOUNCE.format(said=said)], "log": str(log),
                                   "events": ""}))
    with open(log, "ab") as out:
        sup = subprocess.Popen([sys.executable, "-m", "console.cli", "service", "supervise", str(handoff)], cwd=REPO,
                               stdout=out, stderr=out, env={**os.environ, "PYTHONPATH": str(REPO)})
    pid_file = tmp_path / f"serve-{stamp}.pid"
    deadline = time.monotonic() + 30
    while not (pid_file.is_file() and services.find(int(pid_file.read_text()))):
        assert time.monotonic() < deadline and sup.poll() is None, log.read_text()
        time.sleep(0.05)
    return sup, int(pid_file.read_text())


def test_a_sigkilled_service_is_recorded_killed_by_its_supervisor(tmp_path):
    sup, pid = _supervised(tmp_path)
    try:
        os.kill(pid, signal.SIGKILL)
        assert sup.wait(30) == 0
    finally:
        sup.kill()
    [ended] = services.services()
    assert (ended.pid, ended.ending.how, ended.ending.phase, ended.ending.by) == (
        pid, "killed by SIGKILL", "serve", "supervisor")
    assert ended.ending.cause() == "killed by SIGKILL during serve"  # the cause, not the log's last line
    [record] = read_history()
    assert (record["outcome"], record["end"], record["failed_phase"]) == ("killed", "killed by SIGKILL", "serve")
    [event] = T.read()
    assert event.sentence().endswith("failed: killed by SIGKILL during serve") and event.pid == pid


def test_the_services_own_ending_stands_and_a_stop_passes_through_the_supervisor(tmp_path):
    said = "a.end('exited 1', 'serve', 'rank 1 on host-b was killed by SIGKILL'); sys.exit(1);"
    sup, pid = _supervised(tmp_path, said)
    assert sup.wait(30) == 0
    [ended] = services.services()
    assert (ended.ending.how, ended.ending.by, ended.ending.error) == (
        "exited 1", "service", "rank 1 on host-b was killed by SIGKILL")
    assert read_history() == [] and T.read() == []  # the service said it: nothing added
    sup, pid = _supervised(tmp_path, stamp="2")
    sup.send_signal(signal.SIGTERM)  # the supervisor passes a stop on to the service: a stop, not a failure
    assert sup.wait(30) == 0 and not psutil.pid_exists(pid)
    stopped = services.find(pid)
    assert (stopped.ending.how, stopped.ending.by) == ("stopped by SIGTERM", "supervisor")
    assert [e.kind for e in T.read()] == [T.STOPPED] and read_history() == []
