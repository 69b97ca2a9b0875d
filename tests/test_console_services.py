"""The service registry: every `dsv4 serve` of this user is visible, a reused pid never is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from store import services

REPO = Path(__file__).resolve().parents[1]
ANNOUNCE = ("import sys, time; from store.services import Announcement; a = Announcement('/models/m'); "
            "a.serving('http://127.0.0.1:9'); print('ready', flush=True); time.sleep(600)")


def _announcer() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", ANNOUNCE], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_a_service_announced_by_another_process_is_found_with_its_url():
    proc = _announcer()
    try:
        found = services.running()
        assert [(s.pid, s.url, s.model, s.state) for s in found] == [
            (proc.pid, "http://127.0.0.1:9", "/models/m", services.SERVING)]
        assert services.send(found[0], signal.SIGTERM)
        proc.wait(30)
        assert services.running() == []  # its record goes with it
    finally:
        proc.kill()


def test_a_stale_record_whose_pid_now_runs_another_program_is_never_shown_nor_signalled():
    me = psutil.Process()
    # a record naming this test process's pid, but the start time and command line of a
    # service that died long ago: exactly a reused pid
    record = services.Service(os.getpid(), me.create_time() - 1000, ("python", "-m", "console.cli", "serve"),
                              "/models/m", services.SERVING, "http://127.0.0.1:9")
    path = services.registry_dir() / f"{os.getpid()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record.to_json()))
    assert services.send(record) is False  # refused before any signal
    assert services.running() == []
    [gone] = services.services()  # kept as a service that ended, with what is known of its end
    assert (gone.pid, gone.ending.how, gone.ending.phase, gone.ending.by) == (os.getpid(), "gone", "serving", "registry")
    assert services.send(gone) is False
    assert services.dismiss(gone) and not path.exists()


def test_foreign_and_oversized_files_in_the_registry_are_ignored():
    root = services.registry_dir()
    root.mkdir(parents=True, exist_ok=True)
    (root / "notes.txt").write_text("mine")
    (root / "123.json").write_bytes(b"{" * (services.MAX_RECORD_BYTES + 1))
    assert services.running() == []
    assert (root / "notes.txt").read_text() == "mine"  # not a name the registry produced: untouched
