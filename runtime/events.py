"""Registration events: versioned JSON lines, the one format the worker, the console and the
launch history share. No torch here (the console imports this module).

    {"v":1,"ts":…,"phase":"programs","kind":"progress","done":3,"total":8,"unit":"programs",
     "detail":{…}}

A launch of several rank processes (`dsv4 serve --ranks N`) has every rank write to the same
stream; each of its events carries `"rank": r`. Every event names the host it was emitted on
(`"host"`): ranks of one service may run on several; a line without it (an older writer) parses.

`kind` is start | progress | end | log | error. `end` carries `seconds` and the path taken in
`detail` (per program HIT/MISS/STALE; MAP or REPACK + reason).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import IO, Any

VERSION = 1


class Phase(StrEnum):
    """The phases of a launch, in order: the only place they are named."""

    CHECK = "check"
    PROGRAMS = "programs"
    WEIGHTS = "weights"
    UPLOAD = "upload"
    KV = "kv"
    VALIDATE = "validate"
    SERVE = "serve"


PHASES = tuple(Phase)
REGISTRATION = PHASES[:-1]  # every rank runs these before serving; the plan predicts their seconds
KINDS = ("start", "progress", "end", "log", "error")


@dataclass(frozen=True)
class Event:
    phase: str
    kind: str
    ts: float = field(default_factory=time.time)
    done: float | None = None
    total: float | None = None
    unit: str | None = None
    seconds: float | None = None
    message: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    v: int = VERSION
    rank: int | None = None  # the rank process that emitted it (a launch of several ranks)
    host: str | None = None  # the host it was emitted on

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"v": self.v, "ts": round(self.ts, 6), "phase": self.phase, "kind": self.kind}
        for k in ("rank", "host", "done", "total", "unit", "seconds", "message"):
            value = getattr(self, k)
            if value is not None:
                out[k] = value
        if self.detail:
            out["detail"] = self.detail
        return out

    def line(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"), default=str)


class EventError(ValueError):
    """A line that is not a version-1 event."""


def parse(line: str) -> Event:
    """One JSON line → Event; anything else raises EventError (callers show it as a log line)."""
    try:
        raw = json.loads(line)
    except ValueError as e:
        raise EventError(f"not JSON: {e}") from None
    if not isinstance(raw, dict) or raw.get("v") != VERSION:
        raise EventError("not a version-1 event")
    if raw.get("kind") not in KINDS or not isinstance(raw.get("phase"), str):
        raise EventError(f"bad phase/kind: {raw.get('phase')!r}/{raw.get('kind')!r}")
    detail = raw.get("detail") or {}
    rank, host = raw.get("rank"), raw.get("host")
    return Event(raw["phase"], raw["kind"], float(raw.get("ts", 0.0)), raw.get("done"), raw.get("total"),
                 raw.get("unit"), raw.get("seconds"), raw.get("message"),
                 detail if isinstance(detail, dict) else {"value": detail},
                 rank=rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else None,
                 host=host if isinstance(host, str) and host else None)


Sink = Callable[[Event], None]


class Emitter:
    """Fans events out to sinks (a JSON-lines stream, a console renderer, the history)."""

    def __init__(self, *sinks: Sink, rank: int | None = None, host: str | None = None):
        self.sinks = list(sinks)
        self.rank = rank  # stamped on every event: which rank of a multi-rank launch speaks
        self.host = host or socket.gethostname()  # stamped too: which host it speaks from
        self._lock = threading.Lock()  # programs and weights emit from two threads

    def emit(self, phase: str, kind: str, **kw: Any) -> Event:
        event = Event(phase, kind, rank=self.rank, host=self.host, **kw)
        with self._lock:
            for sink in self.sinks:
                sink(event)
        return event

    def log(self, phase: str, message: str, **detail: Any) -> None:
        self.emit(phase, "log", message=message, detail=detail)


def stream_sink(stream: IO[str]) -> Sink:
    def write(event: Event) -> None:
        stream.write(event.line() + "\n")
        stream.flush()

    return write


def open_sink(target: str) -> Sink:
    """'-' → stdout; otherwise a file appended line by line."""
    if target == "-":
        return stream_sink(sys.stdout)
    f = open(Path(target), "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    return stream_sink(f)
