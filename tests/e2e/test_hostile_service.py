"""Hostile clients and operators against a real `dsv4 serve` (issue 11 items 5–7): oversized and
trickled bodies, fuzzed values, clients that leave mid-request or while queued, a full queue,
a port already taken, out-of-range flags and config values, SIGINT mid-request.

One server (eager, tiny, ONE slot, 1 s queue time, 64 KiB bodies, 256-token context) serves
the module; the last test stops it with SIGINT.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from conftest import start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relcounts import record

QUEUE_TIMEOUT, MAX_BODY = 1, 64 << 10
MAX_SEQ = 256
LONG = 240  # tokens of a request meant to hold the slot for far longer than the queue time


@pytest.fixture(scope="module")
def server(tiny_ckpt_ro, tmp_path_factory):
    proc, url, events = start_server(tiny_ckpt_ro, tmp_path_factory.mktemp("hostile"), "--backend", "eager",
                                     "--max-slots", "1", "--queue-timeout", str(QUEUE_TIMEOUT),
                                     "--max-seq", str(MAX_SEQ), "--max-body", "64K", "--validate-tokens", "1")
    yield proc, url, events
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and ",".join(sorted((m.group(1) or "").split(","))) == want:
            return float(m.group(2))
    return 0.0


def _wait_slots(url: str, free: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if httpx.get(f"{url}/health", timeout=30).json()["free_slots"] == free:
            return
        time.sleep(0.02)
    raise AssertionError(f"free_slots never became {free}")


def _raw_request(url: str, path: str, body: dict) -> socket.socket:
    sock = socket.create_connection(_hostport(url))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


# ---- bodies ------------------------------------------------------------------------------------


def test_declared_100mb_body_is_413_before_a_byte_is_read(server, tmp_path_factory):
    proc, url, _ = server
    rss0 = psutil.Process(proc.pid).memory_info().rss
    sock = socket.create_connection(_hostport(url))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 104857600\r\n\r\n" + b"[" * 65536)
    status = sock.recv(4096).split(b"\r\n")[0]
    sock.close()
    grown = psutil.Process(proc.pid).memory_info().rss - rss0
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    assert grown < 32 << 20, grown
    record(tmp_path_factory, "hostile: oversized body (declared)", injection="Content-Length 100 MB, 64 KiB sent",
           trials=1, clean_error=1, note=f"413 from the header; server RSS +{grown >> 20} MiB")


def test_streamed_100mb_body_is_cut_at_the_cap(server):
    _, url, _ = server
    sent = 0

    def body():
        nonlocal sent
        for _ in range(1600):  # 100 MiB in 64 KiB chunks, no Content-Length (chunked)
            sent += 65536
            yield b" " * 65536

    try:
        r = httpx.post(f"{url}/v1/completions", content=body(), headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    except httpx.TransportError:
        pass  # the server answered 413 and closed while we were still sending: also a refusal
    assert sent < 16 << 20  # refused long before 100 MiB went over the wire


def test_a_body_a_little_over_the_cap_gets_its_413_not_a_reset(server):
    """A 413 written while the client still sends would be followed by a close with bytes
    unread, which the kernel answers with a reset: the client reads ECONNRESET, not the 413
    (the hostile run met it once with a 100 KB body). Up to a bound the rest is read first."""
    _, url, _ = server
    statuses = []
    for declared in (True, False) * 25:
        body = b"[" * 900_000
        content = body if declared else iter([body[i:i + 65536] for i in range(0, len(body), 65536)])
        statuses.append(httpx.post(f"{url}/v1/completions", content=content, timeout=60,
                                   headers={"content-type": "application/json"}).status_code)
    assert statuses == [413] * 50


def test_health_answers_while_a_body_trickles_in(server):
    _, url, _ = server
    sock = socket.create_connection(_hostport(url))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 60000\r\n\r\n" + b'{"prompt": "' + b"a" * 30000)
    try:
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    finally:
        sock.close()


# ---- fuzzed values -----------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
HOSTILE_VALUES = {
    "temperature": [1e-300, 5e-324, 1e308, -0.0, 2.0000001, NAN, INF, -INF, 1e-5, True, "0.5"],
    "seed": [-(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 10**30, 1.5, True, "7", None],
    "max_tokens": [0, -1, 2**63, 1.0, True, "1"],
    "prompt": ["\ud800", "a\udfffb", [2**63], [-1], [1.0], [True], [[1, 2]], ["a", "b"], [511], [512], {}, None, ""],
    "stop": ["\ud800", [""], ["x"] * 17, [1], "y" * 300, {"a": 1}],
    "model": ["\ud800", "", 5, ["x"]],
    "stream": ["yes", 1, None],
    "n": [2, 0, "1", 1.5, 129, 10**9, True],
    "top_p": [0, -0.0, 1.0000001, NAN, INF, 1e-300, True, "0.9"],
    "top_k": [-2, 2**63, 1.5, True, 10**9],
    "min_p": [-1e-9, 1.5, NAN, True],
    "presence_penalty": [2.0000001, -INF, NAN, "1"],
    "frequency_penalty": [-2.0000001, INF, True],
    "repetition_penalty": [0, -1, 1e308, NAN, 1e-300],
    "logprobs": [21, -1, True, 1.5, "3", 20, 0],
    "echo": [1, "true", None, True],
    # batch prompts (issue 38): each prompt's own faults, mixed forms, more prompts than the one slot
    "prompts": [[[1]], [[1], [2]], [[]], [[1], []], [[1], "a"], [["a"], [1]], [[[1]]], [[-1]], [[2**63]], [[512]],
                ["\ud800"], ["a", ""], [[1]] * 1025, [[True]], [[1.0]], [None]],
    "best_of": [0, 1, 2, 129, 10**9, True, 1.5, "2", None],
    "logit_bias": [{"1": 101}, {"1": -100.5}, {"x": 1}, {"-1": 1}, {"1" * 30: 1}, {"512": 1}, {"\ud800": 1},
                   {"1": NAN}, {"1": INF}, {"1": True}, {"1": "1"}, {"1": None}, {"1": 100}, {}, None, [], "a",
                   {str(i): 1 for i in range(1025)}],
    "suffix": ["x", 1, None, "", ["a"], "\ud800"],
}
TOP_LEVEL = [b"[]", b'""', b"1", b"null", b"true", b"[" * 100_000, b"1" * 5000, b"\xff\xfe{}", b"{", b""]
BASE = {"/v1/completions": {"prompt": [1, 2], "max_tokens": 1},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}}


def _hostile_bodies():
    """Every hostile value in an otherwise valid body of each endpoint, then hostile bodies.
    JSON carries the lone surrogates as escapes and NaN/Infinity as the bare literals Python's
    parser accepts."""
    for path, base in BASE.items():
        for field, values in HOSTILE_VALUES.items():
            for v in values:
                body = dict(base)
                if path == "/v1/chat/completions" and field in ("prompt", "prompts"):
                    body["messages"] = [{"role": "user", "content": v}]
                else:
                    body["prompt" if field == "prompts" else field] = v
                yield path, json.dumps(body, allow_nan=True).encode()
        for raw in TOP_LEVEL:
            yield path, raw


def _post(url: str, path: str, data: bytes) -> httpx.Response:
    return httpx.post(f"{url}{path}", content=data, headers={"content-type": "application/json"}, timeout=120)


def _counted(url: str) -> dict[tuple[str, str], float]:
    """/metrics' response counts by (endpoint, status)."""
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = re.fullmatch(r'dsv4_requests_total\{endpoint="([^"]*)",status="(\d+)"\} (\S+)', line)
        if m:
            out[m.group(1), m.group(2)] = float(m.group(3))
    return out


def test_hostile_values_are_never_5xx_and_every_answer_is_counted(server, tmp_path_factory):
    proc, url, _ = server
    before = _counted(url)
    statuses: dict[tuple[str, str], int] = {}
    bad = []
    for path, data in _hostile_bodies():
        r = _post(url, path, data)
        key = (path, str(r.status_code))
        statuses[key] = statuses.get(key, 0) + 1
        if r.status_code >= 500 or r.status_code not in (200, 400, 404, 413):
            bad.append((path, data[:80], r.status_code, r.text[:200]))
    assert bad == []
    assert proc.poll() is None
    after = _counted(url)
    assert {k: after.get(k, 0) - before.get(k, 0) for k in statuses} == statuses  # each status, exactly
    by_status: dict[int, int] = {}
    for (_, status), n in statuses.items():
        by_status[int(status)] = by_status.get(int(status), 0) + n
    record(tmp_path_factory, "hostile: fuzzed values", trials=sum(by_status.values()),
           injection="temperature/seed/max_tokens/prompt ids/stop/model/n/top_p/top_k/min_p/penalties/"
                     "logprobs/echo/batch prompts/best_of/logit_bias/suffix edge values, lone surrogates, "
                     "NaN/Infinity literals, 10 hostile top-level bodies; both endpoints",
           recovered=by_status.get(200, 0), clean_error=sum(n for s, n in by_status.items() if 400 <= s < 500),
           data_lost=sum(n for s, n in by_status.items() if s >= 500),
           note=f"statuses {by_status}, each counted in /metrics by endpoint and status")


chat_body = st.fixed_dictionaries({}, optional={
    "messages": st.one_of(
        st.lists(st.fixed_dictionaries({}, optional={
            "role": st.sampled_from(["user", "system", "assistant", "tool", "", None, 3]),
            "content": st.one_of(st.text(max_size=20), st.none(), st.integers(),
                                 st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]),
                                                                 "text": st.text(max_size=5)}), max_size=2)),
        }), max_size=3),
        st.text(max_size=5), st.none()),
    "temperature": st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.none(), st.text(max_size=3)),
    "seed": st.one_of(st.integers(-(2**70), 2**70), st.floats(), st.none()),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=20), st.integers()),
    "stream": st.booleans(),
})


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(body=chat_body)
def test_fuzzed_chat_bodies_are_never_5xx(server, body):
    _, url, _ = server
    body["max_tokens"] = 1
    r = _post(url, "/v1/chat/completions", json.dumps(body, allow_nan=True).encode())
    assert r.status_code < 500, r.text


ids = st.lists(st.integers(-3, 600), max_size=4)
completion_body = st.fixed_dictionaries({}, optional={
    "prompt": st.one_of(st.text(max_size=8), ids, st.lists(st.text(max_size=4), max_size=3), st.lists(ids, max_size=3),
                        st.lists(st.one_of(ids, st.text(max_size=3), st.integers()), max_size=3), st.none()),
    "n": st.one_of(st.integers(-1, 3), st.none()),
    "best_of": st.one_of(st.integers(-1, 3), st.floats(), st.none(), st.text(max_size=2)),
    "logit_bias": st.one_of(st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-2, 600).map(str)),
                                            st.one_of(st.floats(), st.integers(-200, 200), st.booleans(), st.none()),
                                            max_size=3), st.none(), st.lists(st.integers(), max_size=2)),
    "suffix": st.one_of(st.text(max_size=3), st.none()),
    "echo": st.booleans(),
    "logprobs": st.one_of(st.integers(-1, 3), st.none()),
    "stream": st.booleans(),
})


@settings(max_examples=40, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(body=completion_body)
def test_fuzzed_completion_batches_are_never_5xx(server, body):
    _, url, _ = server
    body["max_tokens"] = 1
    r = _post(url, "/v1/completions", json.dumps(body, allow_nan=True).encode())
    assert r.status_code < 500, r.text


# ---- slots: queue time, clients that leave -----------------------------------------------------


def _stream(url: str):
    """A streaming request meant to hold the only slot: (its context, its line iterator);
    leaving the context closes the connection."""
    cm = httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={"prompt": [1, 2, 3], "max_tokens": LONG, "stream": True, "ignore_eos": True})
    return cm, cm.__enter__().iter_lines()


def test_full_queue_is_503_with_retry_after(server, tmp_path_factory):
    _, url, _ = server
    cm, lines = _stream(url)
    next(line for line in lines if line.startswith("data: "))  # it holds the slot now
    t0 = time.perf_counter()
    busy = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 1}, timeout=60)
    waited = time.perf_counter() - t0
    cm.__exit__(None, None, None)
    assert busy.status_code == 503, busy.text
    assert int(busy.headers["retry-after"]) >= 1
    assert busy.json()["error"]["code"] == "queue_timeout"
    _wait_slots(url, 1)
    record(tmp_path_factory, "hostile: full queue", injection="1 slot held by a stream, a second request",
           trials=1, clean_error=1, note=f"503 after {waited:.1f} s (queue time {QUEUE_TIMEOUT} s), "
                                         f"Retry-After {busy.headers['retry-after']}")


def test_client_leaving_a_stream_frees_the_slot_within_one_decode_step(server, tmp_path_factory):
    _, url, _ = server
    before = _metric(url, "dsv4_generated_tokens_total")
    cm, lines = _stream(url)
    got = 0
    for line in lines:
        got += line.startswith("data: ")
        if got == 3:
            break
    cm.__exit__(None, None, None)  # the client leaves mid-stream
    at_close = _metric(url, "dsv4_generated_tokens_total")
    _wait_slots(url, 1)
    after = _metric(url, "dsv4_generated_tokens_total")
    assert after - at_close <= 2, (before, at_close, after)  # the step in flight, at most one more
    assert after - before < LONG / 2
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": [4], "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200
    record(tmp_path_factory, "hostile: client leaves a stream", injection=f"close after 3 chunks of {LONG}",
           trials=1, recovered=1, note=f"{int(after - before)} tokens generated in all, {int(after - at_close)} "
                                       f"after the close; the slot served the next request")


def test_client_leaving_a_whole_request_is_cancelled_and_counted_499(server, tmp_path_factory):
    _, url, _ = server
    gone = _metric(url, "dsv4_requests_total", endpoint="/v1/completions", status="499")
    sock = _raw_request(url, "/v1/completions", {"prompt": [7, 8], "max_tokens": LONG, "ignore_eos": True})
    _wait_slots(url, 0)
    time.sleep(0.3)  # a few decode steps in
    sock.close()
    at_close = _metric(url, "dsv4_generated_tokens_total")
    _wait_slots(url, 1)
    after = _metric(url, "dsv4_generated_tokens_total")
    assert after - at_close <= 2
    deadline = time.time() + 30
    while _metric(url, "dsv4_requests_total", endpoint="/v1/completions", status="499") == gone:
        assert time.time() < deadline
        time.sleep(0.05)
    record(tmp_path_factory, "hostile: client leaves a whole request", injection="socket closed mid-generation",
           trials=1, recovered=1, note=f"{int(after - at_close)} tokens after the close; counted 499")


def test_client_leaving_while_queued_never_runs(server):
    _, url, _ = server
    cm, lines = _stream(url)
    next(line for line in lines if line.startswith("data: "))
    queued = _raw_request(url, "/v1/completions", {"prompt": [9], "max_tokens": LONG, "ignore_eos": True})
    deadline = time.time() + 30
    while httpx.get(f"{url}/health", timeout=30).json()["queued"] != 1:
        assert time.time() < deadline
        time.sleep(0.02)
    queued.close()
    while httpx.get(f"{url}/health", timeout=30).json()["queued"] != 0:
        assert time.time() < deadline
        time.sleep(0.02)
    cm.__exit__(None, None, None)
    _wait_slots(url, 1)
    assert httpx.get(f"{url}/health", timeout=30).json()["queued"] == 0


# ---- the operator's side: port, flags, config --------------------------------------------------


def _dsv4(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "console.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_port_in_use_is_one_line_before_registration(tiny_ckpt_ro, tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    events = tmp_path / "events.jsonl"
    try:
        r = _dsv4("serve", str(tiny_ckpt_ro), "--device", "cpu", "--backend", "eager", "--max-seq", "64",
                  "--port", str(holder.getsockname()[1]), "--events", str(events))
    finally:
        holder.close()
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "cannot listen" in r.stderr and "--port" in r.stderr
    assert not events.exists() or events.read_text() == ""  # no phase started


@pytest.mark.parametrize(("flags", "says"), [
    (["--port", "70000"], "--port 70000 is out of range"),
    (["--port", "-1"], "--port -1 is out of range"),
    (["--memory-utilization", "nan"], "--memory-utilization nan is out of range"),
    (["--memory-utilization", "1.5"], "--memory-utilization 1.5 is out of range"),
    (["--events", "{tmp}/missing/events.jsonl"], "does not exist"),
    (["--events", "{tmp}/events.fifo"], "not a regular file"),  # appending would block on the FIFO
    (["--queue-timeout", "inf"], "--queue-timeout inf is out of range"),
    (["--max-slots", "0"], "--max-slots 0 is out of range"),
    (["--max-seq", "4"], "--max-seq 4 is out of range"),
])
def test_bad_serve_flags_are_one_line_exit_1(tiny_ckpt_ro, tmp_path, flags, says):
    os.mkfifo(tmp_path / "events.fifo")
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    r = _dsv4("serve", str(tiny_ckpt_ro), "--device", "cpu", *flags)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("dsv4 serve: ") and says in r.stderr, r.stderr


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("num_hidden_layers", -3, "1..1024"),
    ("hidden_size", -256, "32..65536"),
    ("head_dim", 0, "2..4096"),
    ("hc_sinkhorn_iters", 10**9, "0..1000"),
    ("num_nextn_predict_layers", 10**6, "0..16"),
    ("vocab_size", 2**40, "258..4194304"),
    ("hc_eps", "NaN", "1e-30..1"),
])
def test_out_of_range_config_is_named_with_its_range_by_check(tiny_ckpt_ro, tmp_path, field, value, allowed):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt_ro, ckpt)
    text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(re.sub(rf'"{field}": [^,\n]+', f'"{field}": {value}', text))
    r = _dsv4("check", str(ckpt), timeout=60)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and f"'{field}'" in r.stderr and f"allowed {allowed}" in r.stderr, r.stderr


@pytest.mark.parametrize("damage", ["truncated", "not json", "directory", "fifo", "ids past the vocabulary"])
def test_broken_tokenizer_json_is_one_line_at_check(tiny_ckpt_ro, tmp_path, damage):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt_ro, ckpt)
    tok = ckpt / "tokenizer.json"
    good = tok.read_text()
    tok.unlink()
    if damage == "truncated":
        tok.write_text(good[: len(good) // 2])
    elif damage == "not json":
        tok.write_text("tokenizer")
    elif damage == "directory":
        tok.mkdir()
    elif damage == "fifo":
        os.mkfifo(tok)
    else:
        data = json.loads(good)
        data["model"]["vocab"]["<far>"] = 10_000
        tok.write_text(json.dumps(data))
    r = _dsv4("check", str(ckpt), timeout=60)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and "tokenizer.json" in r.stderr, r.stderr


# ---- last: SIGINT drains the module's server ---------------------------------------------------


def test_sigint_drains_the_request_in_flight_and_exits_0(server):
    proc, url, events = server
    result = {}

    def in_flight():
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 12, "ignore_eos": True},
                       timeout=120)
        result["status"], result["tokens"] = r.status_code, len(r.json()["choices"][0]["token_ids"])

    t = threading.Thread(target=in_flight)
    t.start()
    _wait_slots(url, 0)
    proc.send_signal(signal.SIGINT)
    t.join(timeout=120)
    assert proc.wait(timeout=60) == 0
    assert result == {"status": 200, "tokens": 12}
    assert "stopped: drained" in events.read_text()
