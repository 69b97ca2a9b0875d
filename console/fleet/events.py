"""What happened on the hosts, as values: an action started or ended (with its hosts), a step of
it, a host stale, unreachable or back (with how long), a service registering, serving, failed
(its rank, host and reason) or stopped. Each says itself in a sentence (`FleetEvent.sentence`):
the fleet log shows sentences, never a raw record.

Events are kept per host (`FleetLog`) and merge by time into one timeline (`timeline`); each is
a frozen value with `to_json`/`from_json`, so a host's events can be kept on disk and a
timeline merged from several. Torch-free, no Textual.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from console import fmt

FLEET = ""  # the host of an event about the fleet as a whole (an action over several hosts)
# kinds
STARTED, STEP, LINE, PROGRESS, ENDED = "action.started", "action.step", "action.line", "action.progress", "action.ended"
STALE, UNREACHABLE, BACK = "host.stale", "host.unreachable", "host.back"
LEFT_OUT, BROUGHT_BACK = "host.left_out", "host.brought_back"
REGISTERING, SERVING, FAILED, STOPPED = "service.registering", "service.serving", "service.failed", "service.stopped"
KEPT = 500  # events kept per host


@dataclass(frozen=True, kw_only=True)
class FleetEvent:
    kind: str
    host: str = FLEET
    ts: float = field(default_factory=time.time)
    action: str = ""
    hosts: tuple[str, ...] = ()  # an action's hosts
    text: str = ""  # a step's label, a line, a reason, how a service ended
    ok: bool | None = None  # an action's outcome
    seconds: float | None = None  # an action's time, how long a host was away or stale
    rank: int | None = None  # a failed service's rank
    url: str = ""  # a serving service's
    pid: int | None = None  # a service's, a node's
    done: float | None = None  # progress
    total: float | None = None
    event: Any = field(default=None, compare=False, repr=False)  # the command's own runtime.events.Event, if any

    def sentence(self) -> str:
        """The event in words, as the fleet log says it."""
        on = ", ".join(self.hosts) or self.host
        took = f" in {fmt.duration(self.seconds)}" if self.seconds is not None else ""
        where = f" on {self.host}" if self.host else ""
        match self.kind:
            case "action.started":
                return f"{self.action} started on {on}" + (f": {self.text}" if self.text else "")
            case "action.ended":
                if self.ok:
                    return f"{self.action} done on {on}{took}"
                return f"{self.action} failed on {on}{took}" + (f": {self.text}" if self.text else "")
            case "action.step" | "action.line":
                if self.action:
                    return f"{self.action}{where}: {self.text}"
                return f"{self.host}: {self.text}" if self.host else self.text
            case "action.progress":
                count = f" {self.done:g}/{self.total:g}" if self.done is not None and self.total else ""
                return f"{self.action}{where}: {self.text}{count}"
            case "host.stale":
                return f"{self.host} stale: {self.text}"
            case "host.unreachable":
                return f"{self.host} unreachable: {self.text}"
            case "host.back":
                return f"{self.host} back after {fmt.duration(self.seconds or 0)}" + (f" ({self.text})" if self.text else "")
            case "host.left_out":
                return f"{self.host} left out: ranks, plans and launches cover the others"
            case "host.brought_back":
                return f"{self.host} brought back into the fleet"
            case "service.registering":
                return f"service registering on {self.host}" + (f" (pid {self.pid})" if self.pid else "") + \
                    (f": {self.text}" if self.text else "")
            case "service.serving":
                return f"service serving {self.url or ''} on {self.host}".replace("  ", " ") + \
                    (f" (pid {self.pid})" if self.pid else "")
            case "service.failed":
                return f"service on {self.host} failed: {self.text}".rstrip(": ")
            case "service.stopped":
                return f"service on {self.host} stopped" + (f": {self.text}" if self.text else "")
        return f"{self.kind}{where}: {self.text}"

    def line(self) -> str:
        """`14:02:33 <sentence>`: the event with its local time."""
        return f"{time.strftime('%H:%M:%S', time.localtime(self.ts))} {self.sentence()}"

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "event"}
        out["hosts"] = list(self.hosts)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> FleetEvent:
        known = {f.name: raw[f.name] for f in fields(cls) if f.name in raw and f.name != "event"}
        known["hosts"] = tuple(str(h) for h in raw.get("hosts") or ())
        return cls(**known)


def timeline(*streams: Iterable[FleetEvent]) -> list[FleetEvent]:
    """Events of several hosts (or several files of one) as one list, oldest first."""
    return sorted((e for s in streams for e in s), key=lambda e: e.ts)


class FleetLog:
    """Every host's events, kept per host (the fleet's own under FLEET); listeners hear each one
    as it is added (the fleet screen's log, `dsv4 fleet`'s output). Thread-safe: the collector
    adds from its thread."""

    def __init__(self) -> None:
        self.by_host: dict[str, deque[FleetEvent]] = {}
        self.listeners: list[Callable[[FleetEvent], None]] = []
        self._lock = threading.Lock()

    def add(self, event: FleetEvent) -> FleetEvent:
        with self._lock:
            self.by_host.setdefault(event.host, deque(maxlen=KEPT)).append(event)
            listeners = list(self.listeners)
        for listen in listeners:
            listen(event)
        return event

    def events(self, host: str | None = None) -> list[FleetEvent]:
        """One host's events (None: every host's, merged by time)."""
        with self._lock:
            if host is not None:
                return list(self.by_host.get(host, ()))
            streams = [list(s) for s in self.by_host.values()]
        return timeline(*streams)

    def sentences(self) -> list[str]:
        return [e.sentence() for e in self.events()]
