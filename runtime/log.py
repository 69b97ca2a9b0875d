"""The service's log: the first thing an operator reads.

One line per request (`access_line`: time, request id, client, method, path, status, the model
id the client sent, prompt and generated tokens, time to first token, total seconds, finish
reason, the API key's name), a summary every 10 s while there is work (`summary_line`), each
registration phase (`PhaseLines`, an events sink), and every warning or error as one sentence.
A failure the project knows (a rank or host lost, a client gone, a queue timeout, a bad request)
is one line with its cause; a traceback means a bug (`Known`, `install`'s thread hook).

Each line goes to stderr and to the service's own log file (`store.logs`: capped, rotated, the
previous run's kept beside it), as text or, with `--log-format json`, as JSON lines with the
same words in `msg` and the figures as fields:

    2026-01-05 14:02:33.120 INFO  access 127.0.0.1:50412 "POST /v1/completions" 200 id=cmpl-3f…
        model=tiny prompt=12 gen=16 ttft=0.052s total=0.810s finish=length
    {"ts":"2026-01-05T14:02:33.120+01:00","time":1767618153.12,"level":"info","logger":"access",
        "msg":"127.0.0.1:50412 \"POST …","status":200,"prompt_tokens":12,…}

Torch-free and FastAPI-free: the node supervisor reads these lines back (`error_of`).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from store import logs
from store.errors import UserError

TEXT, JSON = "text", "json"
FORMATS = (TEXT, JSON)
ACCESS, SUMMARY, PHASE, SERVICE = (logging.getLogger(f"dsv4.{n}") for n in ("access", "summary", "phase", "service"))
SUMMARY_EVERY_S = 10.0
QUIET_PATHS = ("/health", "/metrics")  # a console or a scraper polls them every few seconds: an answer of
# theirs under 400 is a DEBUG line, left out at the default level, so the requests stay readable


@dataclass
class Access:
    """What the routes learn of one request, for its access line (the middleware makes one per
    request and writes the line once the answer is sent)."""

    id: str
    started: float
    model: str | None = None  # as the client sent it
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    ttft: float | None = None  # seconds from its arrival to its first token
    finish: str = ""
    error: str = ""  # the answer's message, for a status of 400 and up
    sent: bool = False  # the id is the client's (X-Request-Id)


def _kind(name: str) -> str:
    """A logger's name as its lines say it: dsv4.access → access, runtime.serve.batcher → batcher."""
    return name.removeprefix("dsv4.").rsplit(".", 1)[-1] if name.startswith(("dsv4.", "runtime.")) \
        else name.split(".")[0]


class LineFormatter(logging.Formatter):
    """One record, one line (a bug's traceback follows it in text, is a field in JSON)."""

    def __init__(self, style: str = TEXT):
        super().__init__()
        self.style = style

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        trace = self.formatException(record.exc_info) if record.exc_info else ""
        if self.style == JSON:
            out: dict[str, Any] = {"ts": _iso(record.created), "time": round(record.created, 3),
                                   "level": record.levelname.lower(), "logger": _kind(record.name), "msg": message}
            out.update(getattr(record, "fields", None) or {})
            if trace:
                out["traceback"] = trace
            return json.dumps(out, ensure_ascii=False, default=str, separators=(",", ":"))
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        line = f"{stamp} {record.levelname:<5} {_kind(record.name)} {message}"
        return f"{line}\n{trace}" if trace else line


def _iso(t: float) -> str:
    local = time.localtime(t)
    zone = time.strftime("%z", local)
    return time.strftime("%Y-%m-%dT%H:%M:%S", local) + f".{int(t * 1000) % 1000:03d}{zone[:3]}:{zone[3:]}"


class CappedFileHandler(logging.Handler):
    """Lines into a capped, rotated file (`store.logs.append_capped`); a file that cannot be
    written is said once on stderr, and the service goes on."""

    def __init__(self, path: Path, cap: int = logs.LOG_CAP, keep: int = logs.KEEP):
        super().__init__()
        self.path, self.cap, self.keep, self.failed = path, cap, keep, False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode(errors="replace")
            logs.append_capped(self.path, data, self.cap, self.keep)
        except OSError as e:
            if not self.failed:
                self.failed = True
                print(f"dsv4 serve: cannot write its log {self.path} ({e.strerror}); logging to stderr only",
                      file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LogFiles:
    """Where this process logs: its file, and the previous run's of the same slot."""

    path: Path | None
    previous: Path | None = None

    def to_json(self) -> dict[str, str]:
        return {"log_file": str(self.path or ""), "previous_log": str(self.previous or "")}


_current: list[LogFiles] = [LogFiles(None)]


def current() -> LogFiles:
    """Where this process logs (`install` set it; nothing yet: no file)."""
    return _current[0]


def log_path(spec, port: int, rank: int | None) -> Path:
    """The log file of a `dsv4 serve` process: `--log-file`, else `<state>/services/logs/serve-<port>.log`;
    rank r of several writes `<stem>.rank<r><suffix>` beside it."""
    base = Path(spec.log_file).expanduser() if spec.log_file else logs.services_log_dir() / f"serve-{port}.log"
    return base if rank is None else base.with_name(f"{base.stem}.rank{rank}{base.suffix or '.log'}")


def install(style: str = TEXT, path: Path | None = None, shown: bool = False) -> LogFiles:
    """Send this process's log (ours, uvicorn's warnings, Python's warnings, a thread's death) to
    stderr and to `path`'s slot (`store.logs.claim`: the previous run's kept beside it), as
    `style` lines. A slot that cannot be claimed is one line on stderr; logging goes on there.
    `shown`: a terminal display draws the phases, so stderr leaves their lines to the file."""
    formatter = LineFormatter(style)
    stream = logging.StreamHandler(sys.stderr)
    if shown:
        stream.addFilter(lambda record: record.name != PHASE.name)
    handlers: list[logging.Handler] = [stream]
    files = LogFiles(None)
    if path is not None:
        try:
            slot = logs.claim(path)
            files = LogFiles(slot.path, slot.previous)
            handlers.append(CappedFileHandler(slot.path))
        except OSError as e:
            print(f"dsv4 serve: cannot keep a log at {path} ({e.strerror or e}); logging to stderr only",
                  file=sys.stderr, flush=True)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    for noisy in ("uvicorn", "uvicorn.error", "torch", "httpx"):  # their warnings only: our lines say the rest
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").disabled = True  # ours says more (runtime.serve.http.AccessLog)
    warnings.showwarning = _warning
    threading.excepthook = _thread_died
    _current[0] = files
    return files


def _warning(message, category, filename, lineno, file=None, line=None) -> None:
    SERVICE.warning("%s (%s, %s:%d)", message, category.__name__, Path(filename).name, lineno)


def _thread_died(args: threading.ExceptHookArgs) -> None:
    """A thread that ends on an exception: one line when it is a failure we know, its
    traceback otherwise (a bug)."""
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "a thread"
    if args.exc_value is not None and known(args.exc_value):
        SERVICE.error("thread %s stopped: %s", name, args.exc_value)
        return
    SERVICE.error("thread %s died", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


def known(e: BaseException) -> bool:
    """A failure the project knows and words itself (a rank or host lost, a bad file, an
    interrupt): one line, never a traceback."""
    return isinstance(e, UserError | KeyboardInterrupt | InterruptedError)


def say_error(message: str) -> None:
    """One error line: into the log once it is installed, else as `dsv4 serve: …` on stderr."""
    if _current[0].path is not None or logging.getLogger().handlers:
        SERVICE.error("%s", message)
        for handler in logging.getLogger().handlers:
            handler.flush()
    else:
        print(f"dsv4 serve: {message}", file=sys.stderr, flush=True)


def failed(logger: logging.Logger, e: BaseException, what: str, *args: Any) -> None:
    """`what` failed because of `e`: one line with its cause when the failure is one we know (a
    lost rank's RankError names the rank, host and why), with the traceback when it is a bug."""
    if known(e):
        logger.error(f"{what}: %s", *args, e)
    else:
        logger.error(what, *args, exc_info=e)


def error_of(line: str) -> str | None:
    """The message of an ERROR line of this log (text or JSON), else None: how the node
    supervisor finds a rank's own reason in a node's log."""
    text = line.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError:
            return None
        return str(raw.get("msg")) if isinstance(raw, dict) and raw.get("level") == "error" else None
    parts = text.split(" ", 4)
    if len(parts) == 5 and parts[2] == "ERROR":
        return parts[4]
    return text.removeprefix("dsv4 serve: ") if text.startswith("dsv4 serve: ") else None


# ---- the lines ----

def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"


def access_line(a: Access, client: str, method: str, path: str, status: int, key: str | None,
                seconds: float) -> None:
    """Log one request's line (level INFO; WARNING for a 5xx, whatever its cause; DEBUG for a
    status poll that answered, QUIET_PATHS)."""
    words = [f'{client} "{method} {path}" {status} id={a.id}']
    if a.model is not None or a.prompt_tokens is not None:
        words.append(f"model={a.model or '-'}")
    if a.prompt_tokens is not None:
        words.append(f"prompt={a.prompt_tokens} gen={a.completion_tokens or 0} ttft={_secs(a.ttft)}")
    words.append(f"total={_secs(seconds)}")
    if a.finish:
        words.append(f"finish={a.finish}")
    if key:
        words.append(f"key={key}")
    if a.error:
        words.append(f"error={json.dumps(a.error[:300], ensure_ascii=False)}")
    fields = {**{k: v for k, v in asdict(a).items() if k not in ("started", "sent") and v not in (None, "")},
              "client": client, "method": method, "path": path, "status": status, "seconds": round(seconds, 4),
              **({"key": key} if key else {})}
    level = logging.WARNING if status >= 500 \
        else logging.DEBUG if path in QUIET_PATHS and status < 400 else logging.INFO
    ACCESS.log(level, " ".join(words), extra={"fields": fields})


def summary_line(recent, running: int, queued: int, slots: int, free: int, acceptance: float | None) -> str:
    """`last 10 s: 0.4 req/s, prompt 12.0 tok/s, generation 2.5 tok/s; running 2, queued 0, KV 2/4
    slots; TTFT p50 0.64 s p99 >5.12 s, ITL p99 0.41 s, e2e p99 6.1 s; MTP acceptance 63%`."""
    parts = [f"last {recent.window_s:g} s: {recent.requests_s:.2f} req/s, prompt {recent.prompt_tokens_s:.1f} tok/s, "
             f"generation {recent.generation_tokens_s:.1f} tok/s",
             f"running {running}, queued {queued}, KV {slots - free}/{slots} slots"]
    ttft = recent.ttft
    latencies = [f"TTFT p50 {ttft.quantile('p50').text()} p99 {ttft.quantile('p99').text()}"] if ttft.count else []
    latencies += [f"{name} p99 {getattr(recent, key).quantile('p99').text()}"
                  for name, key in (("ITL", "itl"), ("e2e", "e2e")) if getattr(recent, key).count]
    if latencies:
        parts.append(", ".join(latencies))
    if errors := recent.errors:
        parts.append(f"{errors} answered 5xx")
    if acceptance is not None:
        parts.append(f"MTP acceptance {acceptance:.0%}")
    return "; ".join(parts)


def log_summary(recent, running: int, queued: int, slots: int, free: int, acceptance: float | None) -> None:
    SUMMARY.info(summary_line(recent, running, queued, slots, free, acceptance),
                 extra={"fields": {**recent.to_json(), "running": running, "queued": queued,
                                   "kv_slots": slots, "kv_slots_used": slots - free, "mtp_acceptance": acceptance}})


class PhaseLines:
    """An events sink (runtime.events.Emitter): registration's phases as lines — each start, end
    (with its seconds and the path it took), error and log; progress counts stay in the events,
    and the serve phase is the service's own lines' to say (serving, failed, stopped, summaries)."""

    def __call__(self, event) -> None:
        if event.phase == "serve":
            return
        who = f"rank {event.rank} " if event.rank else ""
        fields = {"phase": event.phase, "event": event.kind, **({"rank": event.rank} if event.rank is not None else {}),
                  **({"seconds": round(event.seconds, 4)} if event.seconds is not None else {})}
        if event.kind == "start":
            PHASE.info("%s%s started", who, event.phase, extra={"fields": fields})
        elif event.kind == "end":
            took = f" in {event.seconds:.2f} s" if event.seconds is not None else ""
            path = _path_of(event.phase, event.detail or {})
            PHASE.info("%s%s done%s%s", who, event.phase, took, f": {path}" if path else "", extra={"fields": fields})
        elif event.kind == "error":
            took = f" after {event.seconds:.2f} s" if event.seconds is not None else ""
            PHASE.error("%s%s failed%s: %s", who, event.phase, took, event.message or "", extra={"fields": fields})
        elif event.kind == "log" and event.message:
            PHASE.info("%s%s", who, event.message, extra={"fields": fields})


def _path_of(phase: str, d: dict[str, Any]) -> str:
    """What an ended phase did, in a few words."""
    if phase == "programs" and d.get("counts"):
        return ", ".join(f"{n} {k}" for k, n in sorted(d["counts"].items()) if n)
    if phase == "weights" and d.get("path"):
        return f"{d['path']}" + (f" ({d['reason']})" if d.get("reason") else "")
    if phase == "kv" and d.get("slots") is not None:
        return f"{d['slots']} slots"
    if phase == "validate" and d.get("decode_tokens_per_s") is not None:
        return f"{d['decode_tokens_per_s']} decode tokens/s"
    return ""
