"""The service registry: every `dsv4 serve` of this user is visible, a reused pid never is."""

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
    assert (gone.pid, gone.ending.how, gone.ending.phase, gone.ending.by) == \
        (os.getpid(), "gone", "serving", "registry")
    assert services.send(gone) is False
    assert services.dismiss(gone) and not path.exists()


def test_foreign_and_oversized_files_in_the_registry_are_ignored():
    root = services.registry_dir()
    root.mkdir(parents=True, exist_ok=True)
    (root / "notes.txt").write_text("mine")
    (root / "123.json").write_bytes(b"{" * (services.MAX_RECORD_BYTES + 1))
    assert services.running() == []
    assert (root / "notes.txt").read_text() == "mine"  # not a name the registry produced: untouched


def test_a_registry_sweep_that_read_before_a_console_wrote_never_writes_gone_over_its_words(monkeypatch):
    """The lost update: a sweep reads the record (no ending yet), the console then records
    "killed by SIGKILL", and the sweep writes "gone" — unless the read-compare-write is one."""
    import threading

    proc = _announcer()
    proc.kill()
    proc.wait(30)
    [record] = [s for s in map(services._read, services.registry_dir().glob("*.json")) if s]
    swept, console_done = threading.Event(), threading.Event()
    real_read = services._read

    def sweep_read(path):  # the sweep's read, then the console acts before the sweep writes
        found = real_read(path)
        if threading.current_thread().name == "sweep":
            swept.set()
            console_done.wait(2)  # with the lock, the console waits for the sweep instead
        return found

    monkeypatch.setattr(services, "_read", sweep_read)
    sweep = threading.Thread(target=services.end, args=(record, "gone", "", "", "registry"), name="sweep")
    sweep.start()
    assert swept.wait(30)
    console = threading.Thread(target=lambda: (services.end(record, "killed by SIGKILL", "serve", by="console"),
                                               console_done.set()))
    console.start()
    sweep.join(30)
    console.join(30)
    [ended] = services.services()
    assert (ended.ending.how, ended.ending.by) == ("killed by SIGKILL", "console")


def test_a_service_killed_unseen_ends_gone_once_with_its_last_log_lines_and_its_true_end_in_the_history(tmp_path):
    """SIGKILL of a service nobody waited for: the registry's sweep records "gone" with the last
    lines of its log, and the launch's one history record (the service wrote "ok" when it
    served) gets that end, outcome unknown, never a basis for predictions; a second sweep adds
    nothing."""
    from runtime.launch.history import Likeness, comparable
    from store import history

    log = tmp_path / "serve.log"
    script = ("import time; from store.services import Announcement; a = Announcement('/models/m'); "
              "a.serving('http://127.0.0.1:9'); [print(f'line {i}', flush=True) for i in range(8)]; "
              "print('ready', flush=True); time.sleep(600)")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60  # a hang guard only
        while "ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        [running] = services.running()
        settings = {"model": "/models/m", "backend": "eager", "device": "cpu", "ranks": 1, "max_seq": 64,
                    "sidecar": True, "sidecar_path": "/models/m/x"}
        history.append({"v": 1, "launch": running.identity.key, "outcome": "ok", "pid": proc.pid, **settings,
                        "phases": {"serve": {"seconds": 0.1}}})  # what the service writes when it serves
    finally:
        proc.kill()
        proc.wait(30)
    [gone] = services.services()
    services.services()  # a second sweep: the ending is written already
    assert (gone.ending.how, gone.ending.by, gone.ending.phase) == ("gone", "registry", "serving")
    assert gone.ending.log == ("line 4", "line 5", "line 6", "line 7", "ready")
    raw = [json.loads(line) for line in history.history_path().read_text().splitlines()]
    assert len([r for r in raw if r["launch"] == running.identity.key]) == 2  # "ok", then its end, once
    [record] = history.read_history()  # one record of the launch, with its true end
    assert (record["outcome"], record["end"], record["pid"]) == ("unknown", "gone", proc.pid)
    assert comparable([record], Likeness(settings, False, None)) == []


def test_the_log_tail_reads_a_regular_files_end_only(tmp_path):
    big = tmp_path / "big.log"
    big.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert services.log_tail(str(big)) == tuple(f"line {i}" for i in range(99_995, 100_000))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert services.log_tail(str(fifo)) == ()  # never blocks on a FIFO
    assert services.log_tail(str(tmp_path / "absent")) == () and services.log_tail("") == ()


def test_every_serving_figure_keeps_its_last_minute():
    from console.data.services import FIGURES, MetricsWindow

    window = MetricsWindow()
    for i in range(10):  # a scrape every 10 s: 1000 tokens more each time, i requests running
        figures = window.add(i * 10.0, {("dsv4_generated_tokens_total", ()): 1000.0 * i, ("dsv4_running", ()): i,
                                        ("dsv4_kv_slots", ()): 10, ("dsv4_kv_slots_used", ()): i})
    assert set(figures.history) == set(FIGURES)
    assert figures.history["running"] == tuple(float(i) for i in range(3, 10))  # t ≥ 90 − 60
    assert figures.history["kv_fraction"] == tuple(i / 10 for i in range(3, 10))
    assert figures.history["tokens_s"] == (100.0,) * 7 and figures.tokens_s == 100.0
    assert figures.history["ttft_p50"] == ()  # no latency observed: no history, not zeros


def test_a_service_still_registering_reads_registering_not_failed():
    from console.data.services import ServiceView
    from runtime.contract import FAILED, REGISTERING, Health

    record = services.Service(1, 0.0, ("dsv4", "serve"), "/models/m", services.REGISTERING, "http://127.0.0.1:9")
    health = Health(REGISTERING, "/models/m", "x", 0, 0, 0, 0, 64, phase="weights")
    assert ServiceView(record, "HTTP 503", health).state == "registering"
    assert ServiceView(record, "HTTP 503", Health(FAILED, "/models/m", "x", 0, 0, 0, 0, 64)).state == "failed"
