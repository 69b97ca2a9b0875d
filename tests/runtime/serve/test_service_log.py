"""The service's log (issue 71, item 1), in-process over the service's app and a fake engine: one
access line per request sent, each with its status, model id, tokens, times and finish reason; a
summary line while there is work; a failure we know is one line, a bug keeps its traceback; text
and JSON say the same words."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from door_fakes import fake_launched, key_file, served
from engine_fakes import CountingEngine

from runtime import log as service_log
from runtime.launch.rank_store import RankError
from runtime.serve.app import Limits
from runtime.serve.auth import Door
from runtime.serve.server import _report_stats
from store.api_keys import read_keys


@pytest.fixture
def logged(tmp_path):
    """install() into a JSON log under tmp_path; the process's logging put back after. Yields a
    function reading the log's records (each a dict)."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, threading.excepthook, warnings.showwarning, service_log.current())

    def records(logger: str | None = None) -> list[dict]:
        lines = files.path.read_text().split("\n")[:-1]  # whole lines: one may be half written
        return [r for r in map(json.loads, lines) if logger is None or r["logger"] == logger]

    files = service_log.install(service_log.JSON, tmp_path / "logs" / "serve-1.log")
    try:
        yield records
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])
        threading.excepthook, warnings.showwarning = saved[2], saved[3]
        service_log._current[0] = saved[4]


def test_every_request_sent_leaves_one_access_line_with_what_it_asked_and_got(tmp_path, logged):
    keys = key_file(tmp_path / "keys", alice="sk-alice-0123456789abcdef")
    door = Door(read_keys(keys), frozenset({"/health", "/metrics"}))
    auth = {"Authorization": "Bearer sk-alice-0123456789abcdef"}
    sent = []
    with served(fake_launched(tmp_path), door=door) as svc:
        whole = svc.post("/v1/completions",
                         json={"prompt": [1, 2, 3], "max_tokens": 5, "model": svc.app.state.service.model_id},
                         headers={**auth, "X-Request-Id": "trace-42"})
        sent.append(("/v1/completions", whole.status_code, 3, 5, "trace-42"))
        stream = svc.post("/v1/completions", json={"prompt": [4, 5], "max_tokens": 4, "stream": True,
                                                   "stream_options": {"include_usage": True}}, headers=auth)
        sent.append(("/v1/completions", stream.status_code, 2, 4, None))
        missing = svc.post("/v1/completions", json={"prompt": [1], "model": "m"}, headers=auth)
        sent.append(("/v1/completions", missing.status_code, None, None, None))
        bad = svc.post("/v1/chat/completions", content=b"{not json", headers=auth)
        sent.append(("/v1/chat/completions", bad.status_code, None, None, None))
        refused = svc.post("/v1/completions", json={"prompt": [1]})
        sent.append(("/v1/completions", refused.status_code, None, None, None))
        models = svc.get("/v1/models", headers=auth)
        sent.append(("/v1/models", models.status_code, None, None, None))
        assert svc.get("/health").status_code == 200  # a poll that answered: a DEBUG line, left out
    assert [s for _, s, *_ in sent] == [200, 200, 404, 400, 401, 200]
    assert whole.headers["x-request-id"] == "trace-42" and stream.headers["x-request-id"].startswith("cmpl-")
    lines = logged("access")
    assert [(r["path"], r["status"], r.get("prompt_tokens"), r.get("completion_tokens")) for r in lines] == \
        [(p, s, pt, ct) for p, s, pt, ct, _ in sent]
    first, streamed, not_found, unparsable, no_key, _ = lines
    assert first["id"] == "trace-42" and first["key"] == "alice" and first["finish"] == "length"
    assert 0 < first["ttft"] <= first["seconds"] and first["client"].startswith("127.0.0.1:")
    assert streamed["id"] == stream.headers["x-request-id"] and streamed["completion_tokens"] == 4
    assert not_found["model"] == "m" and "model 'm' does not exist" in not_found["error"]
    assert "not valid JSON" in unparsable["error"] and "needs an API key" in no_key["error"] and "key" not in no_key
    assert all(r["level"] == "info" for r in lines)
    assert re.search(r" prompt=3 gen=5 ttft=\d+\.\d{3}s total=\d+\.\d{3}s finish=length key=alice$", first["msg"])
    assert "model=m " in not_found["msg"] and 'error="model' in not_found["msg"]


def test_a_queue_timeout_and_a_client_gone_are_one_line_each(tmp_path, logged):
    engine = CountingEngine(slots=1, gated=True)
    with served(fake_launched(tmp_path, engine=engine), Limits(queue_timeout=0.3)) as svc:
        holder = threading.Thread(target=svc.post, args=("/v1/completions",),
                                  kwargs={"json": {"prompt": [1], "max_tokens": 2}})
        holder.start()
        while svc.health()["running"] < 1:
            time.sleep(0.01)
        busy = svc.post("/v1/completions", json={"prompt": [1], "max_tokens": 2})
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up waiting
            httpx.post(f"{svc.url}/v1/completions", json={"prompt": [2], "max_tokens": 2}, timeout=0.2)
        engine.allow(1000)
        holder.join()
        deadline = time.monotonic() + 10
        while len(logged("access")) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert busy.status_code == 503
    statuses = sorted(r["status"] for r in logged("access"))
    assert statuses == [200, 499, 503]
    by_status = {r["status"]: r for r in logged("access")}
    assert "every slot is busy" in by_status[503]["error"] and by_status[503]["level"] == "warning"
    assert by_status[499]["error"] == "the client left before its answer"
    assert not any("traceback" in r for r in logged())


def test_a_summary_line_says_what_the_service_does_under_load(tmp_path, logged):
    engine = CountingEngine(slots=2, gated=True)
    with served(fake_launched(tmp_path, engine=engine)) as svc:
        scheduler, metrics = svc.app.state.scheduler, svc.app.state.service.metrics
        server = SimpleNamespace(should_exit=False)
        reporter = threading.Thread(target=_report_stats, args=(scheduler, metrics, server, None, 1), daemon=True)
        reporter.start()
        clients = [threading.Thread(target=svc.post, args=("/v1/completions",),
                                    kwargs={"json": {"prompt": [1, 2, 3, 4], "max_tokens": 60}}) for _ in range(3)]
        for c in clients:
            c.start()
        deadline = time.monotonic() + 30  # a loaded host may start the clients late: wait for all three
        while (scheduler.running, scheduler.queued) != (2, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.allow(2)
        while engine.steps < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        # the first step's tokens are counted (the second step began after): from here, generating;
        # the summaries before were written while the engine held every token back
        generating_since = time.time()
        for _ in range(75):  # tokens trickle out while the summaries are written (both slots full ~2 s)
            engine.allow(1)
            time.sleep(0.03)
        engine.allow(1000)
        for c in clients:
            c.join()
        while not any(s["ttft"]["count"] for s in logged("summary")) and time.monotonic() < deadline:
            time.sleep(0.05)  # a summary after the requests' first tokens
        server.should_exit = True
        reporter.join()
    summaries = logged("summary")
    assert summaries, "no summary line while the service generated"
    busy = [s for s in summaries if s["running"] + s["queued"] > 0]
    # a line's whole second began after: (a record's time: when written, just past its second's end)
    generating = [s for s in busy if s["time"] > generating_since + 1.05]
    assert generating and all(s["generation_tokens_s"] > 0 for s in generating)  # generating: never 0
    full = [s for s in busy if s["running"] == 2 and s["queued"] == 1]  # both slots busy, one waiting
    assert full and full[0]["kv_slots"] == full[0]["kv_slots_used"] == 2
    assert "generation" in full[0]["msg"] and "tok/s" in full[0]["msg"] and "KV 2/2 slots" in full[0]["msg"]
    assert any("TTFT p50" in s["msg"] and s["ttft"]["count"] for s in summaries)


class _LostRankEngine(CountingEngine):
    def step(self, batch, prefill=None, logits_rows=None):
        raise RankError("rank 1 on host-b (pid 4242) was killed by SIGKILL during phase serve")


class _BuggyEngine(CountingEngine):
    def step(self, batch, prefill=None, logits_rows=None):
        raise ZeroDivisionError("a bug of ours")


@pytest.mark.parametrize(("engine", "traceback"), [(_LostRankEngine, False), (_BuggyEngine, True)])
def test_a_failure_we_know_is_one_line_and_a_bug_keeps_its_traceback(tmp_path, logged, engine, traceback):
    with served(fake_launched(tmp_path, engine=engine(slots=1))) as svc:
        assert svc.post("/v1/completions", json={"prompt": [1], "max_tokens": 2}).status_code == 500
    (failed,) = [r for r in logged() if r["level"] == "error"]
    assert failed["logger"] == "batcher" and failed["msg"].startswith("engine step failed")
    assert ("traceback" in failed) == traceback
    if not traceback:
        assert failed["msg"].endswith(": rank 1 on host-b (pid 4242) was killed by SIGKILL during phase serve")


def test_text_and_json_say_the_same_words(tmp_path):
    record = logging.LogRecord("dsv4.access", logging.INFO, __file__, 1, "a %s line", ("said",), None)
    record.fields = {"status": 200}
    text = service_log.LineFormatter(service_log.TEXT).format(record)
    data = json.loads(service_log.LineFormatter(service_log.JSON).format(record))
    assert text.endswith(" INFO  access a said line") and data["msg"] == "a said line" and data["status"] == 200
    assert data["logger"] == "access" and data["level"] == "info" and data["ts"][:4] == text[:4]


def test_an_error_line_is_read_back_from_either_form():
    text = "2026-01-05 14:02:33.120 ERROR service failed: rank 1 on b was killed by SIGKILL"
    assert service_log.error_of(text) == "failed: rank 1 on b was killed by SIGKILL"
    assert service_log.error_of(json.dumps({"level": "error", "msg": "rank 2 stopping: lost"})) == \
        "rank 2 stopping: lost"
    assert service_log.error_of("2026-01-05 14:02:33.120 INFO  access 200") is None
    assert service_log.error_of("dsv4 serve: --port 1 in use") == "--port 1 in use"


def test_a_thread_that_dies_of_a_known_failure_is_one_line(tmp_path, logged):
    def lose() -> None:
        raise RankError("rank 0 on a lost the rendezvous store")

    t = threading.Thread(target=lose, name="rank-watch")
    t.start()
    t.join()
    (line,) = [r for r in logged() if r["level"] == "error"]
    assert line["msg"] == "thread rank-watch stopped: rank 0 on a lost the rendezvous store" and "traceback" not in line


def test_the_log_path_is_the_slot_of_the_port_and_the_rank(tmp_path):
    spec = SimpleNamespace(log_file=None)
    assert service_log.log_path(spec, 8000, None).name == "serve-8000.log"
    assert service_log.log_path(spec, 8000, 1).name == "serve-8000.rank1.log"
    assert service_log.log_path(SimpleNamespace(log_file=Path(tmp_path / "a.log")), 0, 2) == tmp_path / "a.rank2.log"
