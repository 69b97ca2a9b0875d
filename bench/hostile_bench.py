"""`dsv4 bench hostile`: every hostile-request class of issue 68 against a live `dsv4 serve`.

One service (tiny, eager, 2 KV slots, max_seq 256, an API key; `--source DIR`: served from another
checkout, to compare with a release before this one — without keys where it has none). Per class:
the requests sent, the statuses received (`closed`: the connection ended without an answer), the
slowest answer, the service's RSS, open descriptors and free KV slots before and after, and the
bound the class must hold, with whether it held. Then the 4 MiB prompt in detail: /health and a
4-token completion alone and while one (and four) such prompts are handled, and the prompt's own
time to its 400.

Bounds are the bench's (a test never asserts a time): a hostile request never gets a 5xx, the
slots and descriptors come back, a stalled connection is closed within the read timeout (10 s) and
a second, /health during a 4 MiB prompt within 0.5 s.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

KEY = "bench-" + "k" * 32
READ_TIMEOUT = 10.0
HEALTH_DURING_BOUND_S = 0.5
WIDTH = 190  # the classes table is wide: never folded into a narrow column per word
BIG = ("hello world, the quick brown fox " * 130_000)[: (4 << 20) - 200]  # just under --max-body


@dataclass
class Live:
    proc: subprocess.Popen
    url: str
    keyed: bool

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"} if self.keyed else {}

    def get(self, path: str, timeout: float = 120) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=timeout)

    def post(self, path: str, timeout: float = 60, **kw) -> httpx.Response:
        return httpx.post(self.url + path, headers={**self.headers, **kw.pop("headers", {})}, timeout=timeout, **kw)

    def figures(self) -> tuple[float, int, int, int]:
        """(RSS MiB, open descriptors, free KV slots, running) of the service."""
        p = psutil.Process(self.proc.pid)
        h = self.get("/health").json()
        return p.memory_info().rss / 2**20, p.num_fds(), h["free_slots"], h["running"]

    def raw(self, data: bytes, read: bool = True, timeout: float = 60) -> bytes:
        """One connection: `data` sent, the answer read to its end (b"" : closed unanswered)."""
        with socket.create_connection(self.host_port, timeout=timeout) as s:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(data)
            out = b""
            with contextlib.suppress(ConnectionResetError, TimeoutError):
                while read and (chunk := s.recv(65536)):
                    out += chunk
            return out


@dataclass
class Row:
    name: str
    bound: str
    sent: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    slowest: float = 0.0
    before: tuple = ()
    after: tuple = ()
    held: bool = True
    note: str = ""

    def answer(self, status: int | str, seconds: float) -> None:
        self.sent += 1
        self.statuses[str(status)] += 1
        self.slowest = max(self.slowest, seconds)


def _status(raw: bytes) -> int | str:
    return int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1 ") else "closed"


def _timed(row: Row, fn: Callable[[], int | str]) -> None:
    t0 = time.perf_counter()
    try:
        status = fn()
    except httpx.TimeoutException:
        status = "no answer"
    except httpx.TransportError:
        status = "closed"
    row.answer(status, time.perf_counter() - t0)


def _values(live: Live, row: Row) -> None:
    fields = [("prompt", [-1]), ("prompt", [10**9]), ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 10**18),
              ("n", 5_000_000), ("best_of", 10**9), ("logprobs", 10**9), ("top_k", 2**63), ("stop", ["x"] * 100_000),
              ("temperature", 999999), ("temperature", 1e308), ("top_p", 1e308)]
    for name, value in fields:
        _timed(row, lambda n=name, v=value: live.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2,
                                                                               n: v}).status_code)
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 10**9}
    _timed(row, lambda: live.post("/v1/chat/completions", json=chat).status_code)


def _float32(live: Live, row: Row) -> None:
    """What killed the engine thread before (tiny top_p, repetition_penalty near 0), NaN and ±inf
    as JSON literals; then a plain completion must still be served."""
    bodies = [{"top_p": 1e-300}, {"top_p": 1e-40}, {"repetition_penalty": 1e-300}, {"repetition_penalty": 1e-39},
              {"temperature": 1e-300}, {"min_p": 1e-45},
              {"top_p": 1.2e-38, "repetition_penalty": 1.2e-38, "logprobs": 5}]
    for extra in bodies:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 1.0, **extra}).encode()
        _timed(row, lambda b=body: live.post("/v1/completions", content=b).status_code)
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"prompt": [1], "max_tokens": 2, "temperature": %s}' % literal
        _timed(row, lambda b=body: live.post("/v1/completions", content=b).status_code)
    served = _serves(live)
    row.held = served and live.get("/health").status_code == 200
    row.note = (f"after them: a completion {'served' if served else 'NOT served'}, "
                f"/health {live.get('/health').json()['status']}")


def _serves(live: Live) -> bool:
    """Whether a 2-token completion is still served (within a minute)."""
    try:
        return live.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200
    except httpx.HTTPError:
        return False


def _bodies(live: Live, row: Row) -> None:
    for raw in (b"[" * 100_000, b'{"prompt": "\xff\xfe"}', b"\xc3\x28", b'{"prompt": [' * 50_000):
        _timed(row, lambda r=raw: live.post("/v1/completions", content=r).status_code)
    for _ in range(2):  # 10 MB over the 4 MiB cap: a 413, or the connection closed on it
        def big() -> int | str:
            try:
                return live.post("/v1/completions", content=b" " * (10 << 20)).status_code
            except httpx.TransportError:
                return "closed"
        _timed(row, big)


def _door(live: Live, row: Row) -> None:
    if not live.keyed:
        row.note, row.held = "the service has no API keys", False
        return
    head = "GET {} HTTP/1.1\r\nHost: {}\r\n{}Connection: close\r\n\r\n"
    for target, host, auth in [("/v1/models", "x", ""), ("/health", "x", ""), ("/v1/models", "x/health?x=", ""),
                               ("//health", "x", ""), ("/v1%2Fmodels", "x", ""), ("/v1/../health", "x", ""),
                               ("/v1/models", "x", f"Authorization: Bearer {KEY}x\r\n"),
                               ("/metrics", "x", "Authorization: Basic abc\r\n")]:
        _timed(row, lambda t=target, h=host, a=auth: _status(live.raw(head.format(t, h, a).encode())))


def _floods(live: Live, row: Row) -> None:
    one = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n"
    many = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(10_000)) + b"\r\n"
    for data in (one, many, one, many):
        _timed(row, lambda d=data: _status(live.raw(d)))


def _stalled(live: Live, row: Row, count: int, trickle: bool) -> None:
    """`count` connections that never finish their head: one byte a second (slow-loris), or
    nothing at all (abandoned); /health is asked meanwhile; each must be closed by the server."""
    socks = [socket.create_connection(live.host_port, timeout=60) for _ in range(count)]
    t0 = time.perf_counter()
    closed_at: dict[int, float] = {}
    health = []
    deadline = t0 + READ_TIMEOUT * 2 + 5
    for s in socks:
        s.setblocking(False)
    sent = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    tick = 0
    while len(closed_at) < count and time.perf_counter() < deadline:
        t = time.perf_counter()
        health.append(_seconds(lambda: live.get("/health", timeout=60)))
        for i, s in enumerate(socks):
            if i in closed_at:
                continue
            try:
                if trickle and tick < len(sent):
                    s.send(sent[tick:tick + 1])
                data = s.recv(4096)
                if data == b"" or data.startswith(b"HTTP/1.1 408"):
                    closed_at[i] = time.perf_counter() - t0
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                closed_at[i] = time.perf_counter() - t0
        tick += 1
        time.sleep(max(0.0, 1.0 - (time.perf_counter() - t)))
    for s in socks:
        s.close()
    for i in range(count):
        row.answer("closed" if i in closed_at else "open", closed_at.get(i, time.perf_counter() - t0))
    row.held = len(closed_at) == count and max(closed_at.values()) <= READ_TIMEOUT + 2
    row.note = f"/health meanwhile: worst {max(health):.3f} s of {len(health)}"


def _seconds(fn: Callable[[], object]) -> float:
    """How long `fn` took to answer (or to fail: a timeout counts its whole wait)."""
    t0 = time.perf_counter()
    with contextlib.suppress(httpx.HTTPError):
        fn()
    return time.perf_counter() - t0


def _leaving(live: Live, row: Row) -> None:
    """Clients that leave a whole and a streamed request half-way, and one that leaves mid-body."""
    for stream in (False, True, False, True):
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 200, "stream": stream, "ignore_eos": True}).encode()
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        auth = f"Authorization: Bearer {KEY}\r\n".encode() if live.keyed else b""
        with socket.create_connection(live.host_port) as s:
            s.sendall(head + auth + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            time.sleep(0.3)
        row.answer("left", 0.3)
    with socket.create_connection(live.host_port) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n" +
                  (f"Authorization: Bearer {KEY}\r\n".encode() if live.keyed else b"") + b"\r\n" + b'{"prompt":')
        time.sleep(0.3)
    row.answer("left mid-body", 0.3)
    metrics = live.get("/metrics").text
    gone = [ln for ln in metrics.splitlines() if 'endpoint="/v1/completions"' in ln and 'status="499"' in ln]
    bugs = [ln for ln in metrics.splitlines() if 'endpoint="/v1/completions"' in ln and 'status="500"' in ln]
    row.note = (f"499 counted: {gone[0].rsplit(' ', 1)[1] if gone else 0}; "
                f"500: {bugs[0].rsplit(' ', 1)[1] if bugs else 0}")
    row.held = not bugs


def _huge(live: Live, row: Row, at_once: int) -> dict:
    """`at_once` 4 MiB prompts; /health and a 4-token completion meanwhile."""
    alone_health = statistics.median(_seconds(lambda: live.get("/health")) for _ in range(5))
    small = {"prompt": [1, 2, 3], "max_tokens": 4}
    alone_small = statistics.median(_seconds(lambda: live.post("/v1/completions", json=small)) for _ in range(3))
    results: list[tuple[float, int | str]] = []

    def one() -> None:
        t0 = time.perf_counter()
        try:
            status: int | str = live.post("/v1/completions", json={"prompt": BIG, "max_tokens": 4}).status_code
        except httpx.HTTPError:
            status = "no answer"
        results.append((time.perf_counter() - t0, status))

    threads = [threading.Thread(target=one) for _ in range(at_once)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    during_health, during_small = [], []
    while any(t.is_alive() for t in threads):
        during_health.append(_seconds(lambda: live.get("/health")))
        during_small.append(_seconds(lambda: live.post("/v1/completions", json=small)))
    for t in threads:
        t.join()
    for seconds, status in results:
        row.answer(status, seconds)
    worst = max(during_health, default=0.0)
    row.held = worst <= HEALTH_DURING_BOUND_S and all(isinstance(s, int) and s < 500 for _, s in results)
    row.note = f"/health worst {worst:.3f} s during (alone {alone_health:.3f} s)"
    return {"prompts": at_once, "prompt_seconds": max(s for s, _ in results), "health_alone_s": alone_health,
            "health_during_worst_s": worst, "health_during_n": len(during_health), "completion_alone_s": alone_small,
            "completion_during_worst_s": max(during_small, default=0.0)}


def _counts(live: Live, row: Row) -> None:
    def prompt_tokens() -> float:
        for line in live.get("/metrics").text.splitlines():
            if line.startswith('dsv4_tokens_total{kind="prompt"}'):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = prompt_tokens()
    _timed(row, lambda: live.post("/v1/completions", json={"prompt": list(range(1, 11)), "max_tokens": 2, "n": 2,
                                                           "temperature": 1.0}).status_code)
    grew = prompt_tokens() - before
    row.held, row.note = grew == 10, f"a 10-token prompt × 2 choices counted {grew:g} prompt tokens"


CLASSES: list[tuple[str, str, Callable[[Live, Row], object]]] = [
    ("API key: none, wrong, BadHost, //, %2F, ..", "401 each", _door),
    ("values past their bounds", "4xx each, never 5xx", _values),
    ("nesting 100 000 deep, bad UTF-8, 10 MB body", "400 / 413 or closed", _bodies),
    ("1 MiB header, 10 000 headers", "431/400 or closed", _floods),
    ("slow-loris: 100 conns, 1 header byte/s", f"each closed ≤ {READ_TIMEOUT + 2:g} s",
     lambda live, row: _stalled(live, row, 100, True)),
    ("1 000 connections abandoned", f"each closed ≤ {READ_TIMEOUT + 2:g} s",
     lambda live, row: _stalled(live, row, 1000, False)),
    ("clients leave: whole, stream, mid-body", "slots back; 499, no 500", _leaving),
    ("a 4 MiB prompt", f"400; /health ≤ {HEALTH_DURING_BOUND_S} s meanwhile", lambda live, row: _huge(live, row, 1)),
    ("four 4 MiB prompts at once", f"400s; /health ≤ {HEALTH_DURING_BOUND_S} s meanwhile",
     lambda live, row: _huge(live, row, 4)),
    ("a prompt with n=2", "its tokens counted once", _counts),
    # last: before issue 68 one of these killed the engine thread, and every later generation hung
    ("float32 extremes, NaN, ±inf", "400 each; the engine goes on", _float32),
]


def _start(model: Path, tmp: Path, source: Path | None) -> Live:
    env = {**os.environ, "DSV4_STATE_DIR": str(tmp / "state"), "DSV4_KERNEL_CACHE_DIR": str(tmp / "programs")}
    if source is not None:
        env["PYTHONPATH"] = str(source)
    cli = [sys.executable, "-m", "console.cli", "serve"]
    keyed = "--api-key-file" in subprocess.run([*cli, "--help"], capture_output=True, text=True, env=env,
                                               cwd=source).stdout
    extra = []
    if keyed:
        keys = tmp / "keys"
        keys.write_text(f"bench {KEY}\n")
        keys.chmod(0o600)
        extra = ["--api-key-file", str(keys), "--read-timeout", str(READ_TIMEOUT)]
    events = tmp / "events.jsonl"
    proc = subprocess.Popen([*cli, str(model), "--device", "cpu", "--backend", "eager", "--port", "0", "--max-seq",
                             "256", "--max-slots", "2", "--validate-tokens", "1", "--events", str(events), *extra],
                            stdout=subprocess.DEVNULL, stderr=open(tmp / "stderr.log", "wb"), env=env,  # noqa: SIM115
                            cwd=source)  # `-m` puts the working directory first on sys.path
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        for line in events.read_text().splitlines() if events.exists() else ():
            e = json.loads(line)
            if e.get("phase") == "serve" and e.get("kind") == "end":
                return Live(proc, e["detail"]["url"], keyed)
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"dsv4 bench hostile: the service did not start (see {tmp / 'stderr.log'})")


def _settle(live: Live, before: tuple, timeout: float = 15.0) -> tuple:
    """The service's figures once its slots are back (or `timeout` later)."""
    deadline = time.monotonic() + timeout
    while True:
        now = live.figures()
        if (now[2], now[3]) == (before[2], before[3]) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def measure(source: Path | None = None, progress=print) -> dict:
    from runtime.synth.checkpoint import synthesize

    rows, huge = [], []
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-hostile-") as tmp:
        model = synthesize("tiny", Path(tmp) / "ckpt", seed=0)
        live = _start(model, Path(tmp), source)
        try:
            broken = ""
            for name, bound, fn in CLASSES:
                if broken:
                    rows.append(Row(name, bound, held=False, note=f"not run: nothing served since {broken}",
                                    before=("-",) * 4, after=("-",) * 4))
                    continue
                progress(f"{name} …")
                row = Row(name, bound, before=live.figures())
                detail = fn(live, row)
                row.after = _settle(live, row.before)
                if isinstance(detail, dict):
                    huge.append(detail)
                server_errors = sum(n for s, n in row.statuses.items() if s.isdigit() and int(s) >= 500)
                back = row.after[2:] == row.before[2:] and row.after[1] <= row.before[1] + 2
                row.held = row.held and not server_errors and back and live.proc.poll() is None
                rows.append(row)
                if not _serves(live):
                    broken = f"'{name}'"
        finally:
            live.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                live.proc.wait(60)
            live.proc.kill()
    return {"source": str(source or "this checkout"), "keyed": live.keyed, "read_timeout_s": READ_TIMEOUT,
            "classes": [{"class": r.name, "bound": r.bound, "sent": r.sent, "statuses": dict(r.statuses),
                         "slowest_s": round(r.slowest, 3), "rss_mib": [_mib(r.before[0]), _mib(r.after[0])],
                         "open_fds": [r.before[1], r.after[1]], "free_slots": [r.before[2], r.after[2]],
                         "held": r.held, "note": r.note} for r in rows],
            "huge_prompt": huge}


def _mib(value) -> float | str:
    return round(value, 1) if isinstance(value, float) else value


def main(json_output: bool = False, source: Path | None = None) -> int:
    from bench.report import print_json, print_table

    result = measure(source, progress=(lambda _: None) if json_output else (lambda m: print(m, file=sys.stderr)))
    if json_output:
        print_json(result)
        return 0
    print_table(f"dsv4 bench hostile: tiny, eager, 2 slots ({result['source']})",
                ("class", "sent", "statuses", "slowest s", "RSS MiB", "fds", "free slots", "bound", "held", "note"),
                [(c["class"], c["sent"], " ".join(f"{k}×{v}" for k, v in sorted(c["statuses"].items())),
                  f"{c['slowest_s']:.3f}", "→".join(map(str, c["rss_mib"])), "→".join(map(str, c["open_fds"])),
                  "→".join(map(str, c["free_slots"])), c["bound"], "yes" if c["held"] else "NO", c["note"])
                 for c in result["classes"]], width=WIDTH)
    print_table("4 MiB prompts (just under --max-body): what everyone else waits",
                ("prompts", "their 400 s", "/health alone s", "/health during, worst s", "4-token completion alone s",
                 "during, worst s"),
                [(h["prompts"], f"{h['prompt_seconds']:.2f}", f"{h['health_alone_s']:.3f}",
                  f"{h['health_during_worst_s']:.3f}", f"{h['completion_alone_s']:.3f}",
                  f"{h['completion_during_worst_s']:.3f}") for h in result["huge_prompt"]], width=WIDTH)
    return 0
