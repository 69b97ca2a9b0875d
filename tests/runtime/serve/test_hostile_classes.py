"""Every hostile-request class of issue 68 against a real uvicorn serving the app over a fake
engine (tests/door_fakes): each is a 4xx naming the field, or a closed connection — never a 5xx,
never a message carrying a path, an address or a traceback — and after each the service's free
slots, running and queued requests and open descriptors are back where they were (`Leaks`)."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time

import pytest
from door_fakes import Leaks, fake_launched, served
from engine_fakes import CountingEngine

from runtime.serve.app import Limits

READ_TIMEOUT, MAX_BODY = 1.0, 4 << 20  # the default cap: a 100 000-item list fits under it
LEAKY = re.compile(r"Traceback|File \"|0x[0-9a-fA-F]{6,}|(?<![\w.])/(?:[\w.-]+/)+[\w.-]*")


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    limits = Limits(max_body_bytes=MAX_BODY, queue_timeout=1.0, read_timeout=READ_TIMEOUT)
    with served(fake_launched(tmp_path_factory.mktemp("hostile")), limits=limits) as s:
        yield s


@pytest.fixture
def leaks(svc):
    watch = Leaks(svc)
    yield watch
    watch.check()


def _says(r, field: str) -> None:
    """A 4xx whose error names `field`, and whose message leaks nothing."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert (error["param"] or "").split(".")[0] == field and error["message"].split(":")[0] == error["param"], error
    assert not LEAKY.search(error["message"]), error["message"]


BASE = {"prompt": [1, 2], "max_tokens": 2}
FIELDS = [
    ("prompt", [-1]), ("prompt", [512]), ("prompt", [2**63]), ("prompt", [[1], [-5]]), ("max_tokens", 0),
    ("max_tokens", -1), ("max_tokens", 10**18), ("max_tokens", 1e18), ("n", 10**9), ("n", 5_000_000),
    ("best_of", 10**9), ("logprobs", 10**9), ("logprobs", -1), ("temperature", float("nan")),
    ("temperature", float("inf")), ("temperature", -float("inf")), ("temperature", 1e308), ("temperature", 999999),
    ("top_p", float("nan")), ("top_p", 1e308), ("top_p", -float("inf")), ("stop", ["x"] * 100_000),
    ("logit_bias", {str(i): 1 for i in range(100_000)}),
]


@pytest.mark.parametrize(("field", "value"), FIELDS, ids=[f"{f}={str(v)[:12]}" for f, v in FIELDS])
def test_a_value_past_its_bound_is_a_4xx_naming_its_field(svc, leaks, field, value):
    body = json.dumps({**BASE, field: value}, allow_nan=True).encode()
    _says(svc.post("/v1/completions", content=body, headers={"content-type": "application/json"}), field)


@pytest.mark.parametrize(("field", "value"), [("top_logprobs", 10**9), ("top_logprobs", -1), ("n", 10**9),
                                              ("max_completion_tokens", 10**18), ("temperature", float("nan"))])
def test_chat_values_past_their_bounds(svc, leaks, field, value):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, field: value}
    _says(svc.post("/v1/chat/completions", content=json.dumps(body, allow_nan=True).encode()), field)


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                 b'{"prompt": "\xff\xfe"}', b"\xc3\x28", b'{"prompt": "\\ud800"}'])
def test_deep_nesting_and_invalid_utf8_are_400s(svc, leaks, raw):
    r = svc.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and not LEAKY.search(r.json()["error"]["message"]), r.text[:200]


def test_a_10mb_body_over_the_cap_is_413(svc, leaks):
    r = svc.post("/v1/completions", content=b" " * (10 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def _connect(svc) -> socket.socket:
    return socket.create_connection((svc.host, svc.port), timeout=30)


def _read_all(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


@pytest.mark.parametrize("head", [
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(10_000)) + b"\r\n",
], ids=["one 1 MiB header", "10 000 headers"])
def test_header_floods_are_a_4xx_and_a_closed_connection(svc, leaks, head):
    with _connect(svc) as s:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # closed on us mid-flood: refused too
            s.sendall(head)
        answer = _read_all(s)
    assert answer == b"" or answer.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), answer[:100]


def test_slow_loris_is_cut_off_at_the_read_timeout(svc, leaks):
    """One header byte every 0.2 s: the head never completes within the deadline."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    with _connect(svc) as s:
        t0 = time.monotonic()
        sent = 0
        try:
            while sent < len(head):
                s.sendall(head[sent:sent + 1])
                sent += 1
                time.sleep(0.2)
                if time.monotonic() - t0 > 30:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer[:80]
    assert sent < len(head)  # cut off long before the head was whole


def test_a_thousand_abandoned_connections_are_closed_and_health_answers_meanwhile(svc, leaks):
    socks = [_connect(svc) for _ in range(1000)]
    try:
        assert svc.get("/health").status_code == 200  # answered while all of them are open
        time.sleep(READ_TIMEOUT + 0.5)
        closed = 0
        for s in socks:
            s.settimeout(5)
            closed += s.recv(1) == b""
        assert closed == 1000
    finally:
        for s in socks:
            s.close()


def test_a_body_that_stops_arriving_is_408_and_closed(svc, leaks):
    with _connect(svc) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n" + b'{"prompt": "')
        answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 408") and b"connection: close" in answer.lower(), answer[:200]
    assert b"body: nothing arrived for 1 s" in answer


def test_a_body_still_sent_after_its_answer_is_cut_off(svc, leaks):
    """413 is answered at once from Content-Length; a client then trickling the body forever
    is closed at the deadline, not read for ever."""
    with _connect(svc) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
        status = s.recv(4096).split(b"\r\n")[0]
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < 30:
                s.sendall(b"x")
                time.sleep(0.2)
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert status == b"HTTP/1.1 413 Request Entity Too Large"
    assert time.monotonic() - t0 < 30


def _count(svc, pattern: str) -> float:
    m = re.search(pattern + r" (\S+)", svc.get("/metrics").text)
    return float(m.group(1)) if m else 0.0


def test_a_client_leaving_mid_body_is_a_499_never_a_500(svc, leaks):
    gone = r'dsv4_requests_total\{endpoint="/v1/completions",status="499"\}'
    bugs = r'dsv4_requests_total\{endpoint="/v1/completions",status="500"\}'
    before, bugs_before = _count(svc, gone), _count(svc, bugs)
    with _connect(svc) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b'{"prompt":')
        time.sleep(0.2)
    deadline = time.monotonic() + 10
    while _count(svc, gone) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _count(svc, gone) == before + 1 and _count(svc, bugs) == bugs_before


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_leaving_halfway_frees_its_slot_within_one_step(tmp_path, stream):
    engine = CountingEngine(slots=1, gated=True)
    with served(fake_launched(tmp_path, engine=engine)) as svc:
        leaks = Leaks(svc)
        body = json.dumps({"prompt": [1], "max_tokens": 50, "stream": stream, "ignore_eos": True}).encode()
        with _connect(svc) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            engine.allow(3)  # the prefill and two decode steps: half-way is any time now
            deadline = time.monotonic() + 30
            while engine.steps < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
        at_close = engine.steps
        while svc.health()["free_slots"] == 0 and time.monotonic() < deadline:
            engine.allow(1)  # one step at a time: the one in flight, then the slot must be free
            time.sleep(0.05)
        assert svc.health()["free_slots"] == 1 and engine.steps - at_close <= 2
        engine.allow(1000)
        leaks.check()


def test_a_prompt_is_counted_once_however_many_choices_and_closed_streams_are_cancelled(svc, leaks):
    prompt = r'dsv4_tokens_total\{kind="prompt"\}'
    cancelled = r'dsv4_generations_total\{reason="cancelled"\}'
    before = _count(svc, prompt)
    r = svc.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "n": 2, "temperature": 1.0})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5
    assert _count(svc, prompt) == before + 5
    c0 = _count(svc, cancelled)
    with _connect(svc) as s:
        body = json.dumps({"prompt": [1], "max_tokens": 60, "stream": True, "ignore_eos": True, "n": 2}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        got = b""
        while b"data: " not in got:
            got += s.recv(65536)
    deadline = time.monotonic() + 10
    while _count(svc, cancelled) < c0 + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _count(svc, cancelled) == c0 + 2
    assert 'reason="unknown"' not in svc.get("/metrics").text
