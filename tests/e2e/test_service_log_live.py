"""What happened, on a real `dsv4 serve` (issue 71): its log has an access line for each request
sent (status, model id, tokens) and a summary under load; a one-shot /health read of a generating
service says what it generates; a relaunch keeps the previous run's log and says so in the
timeline; a rank killed under load leaves no traceback anywhere, and its cause (the rank, its
host, the signal) is the ending in the registry, the launch history and the timeline, with each
phase the slowest rank's."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
from conftest import MAX_SEQ

from store import history, services, timeline
from store.paths import state_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: Path, out: Path, port: int, *extra: str) -> subprocess.Popen:
    with open(out, "w") as log:  # the process's own output: stdout and stderr
        return subprocess.Popen([sys.executable, "-m", "console.cli", "serve", str(model), "--backend", "eager",
                                 "--device", "cpu", "--port", str(port), "--max-seq", str(MAX_SEQ), *extra],
                                stdout=log, stderr=subprocess.STDOUT, text=True)


def _serving(proc: subprocess.Popen, port: int, timeout: float = 240) -> str:
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"dsv4 serve exited {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("the service did not serve")


def _record(pid: int) -> services.Service:
    found = services.find(pid)
    assert found is not None
    return found


def _json_lines(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.startswith("{")]


def test_a_services_log_says_each_request_and_a_relaunch_keeps_the_previous_run(tiny_ckpt_ro, tmp_path):
    port = _free_port()
    proc = _serve(tiny_ckpt_ro, tmp_path / "first.out", port, "--log-format", "json")
    try:
        url = _serving(proc, port)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        sent = [httpx.post(f"{url}/v1/completions", json={"prompt": "the sea", "max_tokens": 6, "model": model},
                           timeout=120),
                httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 4}, timeout=120),
                httpx.post(f"{url}/v1/completions", json={"prompt": "x", "model": "not-it"}, timeout=30),
                httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, timeout=30)]
        loads = [threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                                  kwargs={"json": {"prompt": "a cat", "max_tokens": 40, "ignore_eos": True},
                                          "timeout": 300}) for _ in range(2)]
        for t in loads:
            t.start()
        deadline, generating = time.monotonic() + 60, None
        while time.monotonic() < deadline:  # one read while it generates: its own rates, never 0
            health = httpx.get(f"{url}/health", timeout=10).json()
            if health["running"] and health["recent"]["10s"]["generation_tokens_s"] > 0:
                generating = health
                break
            time.sleep(0.3)
        assert generating is not None, "a generating service read as idle"
        for t in loads:
            t.join()
        record = _record(proc.pid)
        assert record.log_file == str(state_dir() / "services" / "logs" / f"serve-{port}.log")
        assert generating["ranks"][0]["log"] == record.log_file and generating["ranks"][0]["rss_bytes"] > 0
        time.sleep(10.5)  # a summary line covers the load
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    lines = _json_lines(record.log_file)
    models, *access = [r for r in lines if r["logger"] == "access"]  # /health's polls that answered: not said
    assert (models["path"], models["status"]) == ("/v1/models", 200)
    assert [(r["path"], r["status"]) for r in access[:4]] == [("/v1/completions", 200), ("/v1/chat/completions", 200),
                                                               ("/v1/completions", 404), ("/v1/completions", 400)]
    for r, answer in zip(access[:2], sent[:2], strict=True):
        usage = answer.json()["usage"]
        assert (r["prompt_tokens"], r["completion_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert access[0]["model"] == model and access[2]["model"] == "not-it" and "max_tokens" in access[3]["error"]
    assert sorted(r["completion_tokens"] for r in access[4:]) == [40, 40] and len(access) == 6
    assert any(r["logger"] == "summary" and r["generation_tokens_s"] > 0 for r in lines)
    assert next(r["msg"] for r in lines if r["logger"] == "phase" and r.get("event") == "end").startswith("check done")
    assert "Traceback" not in (tmp_path / "first.out").read_text()

    again = _serve(tiny_ckpt_ro, tmp_path / "second.out", port)
    try:
        _serving(again, port)
        record = _record(again.pid)
    finally:
        again.send_signal(signal.SIGTERM)
        assert again.wait(60) == 0
    assert record.previous_log == str(state_dir() / "services" / "logs" / f"serve-{port}.prev.log")
    assert _json_lines(record.previous_log) == lines  # the first run's log, whole, beside the second's
    kinds = [(e.kind, e.pid) for e in timeline.read()]
    assert kinds == [(timeline.REGISTERING, proc.pid), (timeline.SERVING, proc.pid), (timeline.STOPPED, proc.pid),
                     (timeline.RELAUNCHED, again.pid), (timeline.SERVING, again.pid), (timeline.STOPPED, again.pid)]


def _rank(launcher: int, rank: int) -> psutil.Process:
    for child in psutil.Process(launcher).children():
        if child.environ().get("RANK") == str(rank):
            return child
    raise AssertionError(f"no rank {rank} under {launcher}")


def test_a_rank_killed_under_load_is_one_line_and_the_cause_everywhere(tiny_ckpt_ro, tmp_path):
    port = _free_port()
    out = tmp_path / "launcher.out"
    proc = _serve(tiny_ckpt_ro, out, port, "--ranks", "2", "--rank-timeout", "2")
    try:
        url = _serving(proc, port)
        answers: list[int] = []

        def load() -> None:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 50, "ignore_eos": True},
                           timeout=120)
            answers.append(r.status_code)

        clients = [threading.Thread(target=load) for _ in range(4)]
        for c in clients:
            c.start()
        while not httpx.get(f"{url}/health", timeout=10).json()["running"]:
            time.sleep(0.05)
        time.sleep(0.5)
        victim = _rank(proc.pid, 1)
        os.kill(victim.pid, signal.SIGKILL)
        for c in clients:
            c.join(120)
        assert proc.wait(60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    assert 503 in answers and set(answers) <= {200, 503}, answers
    record = _record(proc.pid)
    cause = f"rank 1 on {socket.gethostname()} (pid {victim.pid}) was killed by SIGKILL during phase serve"
    assert record.ending.how == "rank 1 killed by SIGKILL" and record.ending.error == cause
    launches = [r for r in history.read_history() if r.get("launch") == record.identity.key]
    assert len(launches) == 1 and launches[0]["error"] == cause and launches[0]["rank"] == 1
    phases = launches[0]["phases"]
    assert all(len(phases[p]["by_rank"]) == 2 and phases[p]["seconds"] == max(phases[p]["by_rank"])
               for p in ("check", "programs", "weights", "kv", "validate"))
    assert launches[0]["seconds"] >= launches[0]["registration_seconds"] > 0
    failed = [e for e in timeline.read() if e.kind == timeline.FAILED]
    assert [(e.rank, e.text) for e in failed] == [(1, cause)]
    logs = [*record.rank_log_files, record.log_file]
    assert len(record.rank_log_files) == 2 and all(Path(p).is_file() for p in logs)
    said = "\n".join(Path(p).read_text() for p in logs) + out.read_text()
    assert "Traceback" not in said
    assert f"ERROR service failed: {cause}" in Path(record.rank_log_files[0]).read_text()
    assert all(line.endswith(f": {cause}") for line in said.splitlines() if "engine step failed" in line)
