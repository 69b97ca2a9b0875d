"""What happened, as one timeline: typed, versioned events kept per host on disk, merged by time
across hosts, repeats counted.

An event (`TimelineEvent`) is a host stale, unreachable or back (with how long); a service
registering, serving, failed (its rank, host and reason), stopped or relaunched; an action
started or ended (with its hosts). Each says itself in a sentence (`sentence`): a timeline shows
sentences, never a raw record. The value is the one both sides use: the service and the node
supervisor append what they see, the console appends what it does and sees of hosts, and the
console's fleet log keeps the same values in memory.

Each host keeps its own file, `<state dir>/timeline/<host>.jsonl`, one JSON line an event,
appended whole in one write without blocking (`store.logs.append_capped`: capped at CAP bytes,
the older events rotated to `<host>.jsonl.1`). Appending never raises: a timeline that cannot be
written must not stop a service. `read` takes one host's file (or the text fetched from another
host), `merge` puts several hosts' events in time order, `counted` folds repeats (k9s's events:
the latest, how many, since when).

Torch-free, and store imports nothing above it.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from store import logs, paths
from store.units import format_duration

VERSION = 1
CAP = 4 << 20  # bytes of a host's timeline file before it rotates (about 20 000 events)
READ_CAP = 4 << 20  # bytes read from the end of each file
FLEET = ""  # the host of an event about the fleet as a whole (an action over several hosts)

# kinds
STARTED, STEP, LINE, PROGRESS, ENDED = "action.started", "action.step", "action.line", "action.progress", "action.ended"
STALE, UNREACHABLE, BACK = "host.stale", "host.unreachable", "host.back"
LEFT_OUT, BROUGHT_BACK = "host.left_out", "host.brought_back"
REGISTERING, SERVING, FAILED, STOPPED, RELAUNCHED = (
    "service.registering", "service.serving", "service.failed", "service.stopped", "service.relaunched")
KINDS = (STARTED, STEP, LINE, PROGRESS, ENDED, STALE, UNREACHABLE, BACK, LEFT_OUT, BROUGHT_BACK, REGISTERING,
         SERVING, FAILED, STOPPED, RELAUNCHED)


@dataclass(frozen=True, kw_only=True)
class TimelineEvent:
    """One thing that happened, where and when; `v` is the format's version."""

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
    v: int = VERSION

    def sentence(self) -> str:
        """The event in words, as a timeline says it."""
        on = ", ".join(self.hosts) or self.host
        took = f" in {format_duration(self.seconds)}" if self.seconds is not None else ""
        where = f" on {self.host}" if self.host else ""
        said = f": {self.text}" if self.text else ""
        pid = f" (pid {self.pid})" if self.pid else ""
        match self.kind:
            case "action.started":
                return f"{self.action} started on {on}{said}"
            case "action.ended":
                return f"{self.action} done on {on}{took}" if self.ok else f"{self.action} failed on {on}{took}{said}"
            case "action.step" | "action.line":
                if self.action:
                    return f"{self.action}{where}: {self.text}"
                return f"{self.host}: {self.text}" if self.host else self.text
            case "action.progress":
                count = f" {self.done:g}/{self.total:g}" if self.done is not None and self.total else ""
                return f"{self.action}{where}: {self.text}{count}"
            case "host.stale":
                return f"{self.host} stale{said}"
            case "host.unreachable":
                return f"{self.host} unreachable{said}"
            case "host.back":
                return (f"{self.host} back after {format_duration(self.seconds or 0)}"
                        + (f" ({self.text})" if self.text else ""))
            case "host.left_out":
                return f"{self.host} left out: ranks, plans and launches cover the others"
            case "host.brought_back":
                return f"{self.host} brought back into the fleet"
            case "service.registering":
                return f"service registering{where}{pid}{said}"
            case "service.serving":
                return f"service serving {self.url}{where}".replace("  ", " ") + pid
            case "service.failed":
                rank = f" (rank {self.rank})" if self.rank is not None else ""
                return f"service{where} failed{rank}{said}"
            case "service.stopped":
                return f"service{where} stopped{said}"
            case "service.relaunched":
                return f"service relaunched{where}{pid}{said}"
        return f"{self.kind}{where}{said}"

    def line(self) -> str:
        """`14:02:33 <sentence>`: the event with its local time."""
        return f"{time.strftime('%H:%M:%S', time.localtime(self.ts))} {self.sentence()}"

    def key(self) -> tuple:
        """What makes two events repeats of one another (their time, pid and figures aside; two
        services serving at two URLs are two events)."""
        return self.kind, self.host, self.action, self.hosts, self.text, self.ok, self.rank, self.url

    def to_json(self) -> dict[str, Any]:
        """Its fields, those at their defaults left out (a subclass's own fields stay home)."""
        out = {f.name: getattr(self, f.name) for f in fields(TimelineEvent)
               if f.name in _KEPT or getattr(self, f.name) not in (None, "", ())}
        out["hosts"] = list(self.hosts)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> TimelineEvent:
        """The event of a JSON object; ValueError for another version or a malformed one."""
        if raw.get("v", VERSION) != VERSION:
            raise ValueError(f"timeline event v{raw.get('v')}; this reader takes v{VERSION}")
        if not isinstance(raw.get("kind"), str):
            raise ValueError("timeline event without a kind")
        known = {f.name: raw[f.name] for f in fields(cls) if f.name in raw and f.name in _FIELDS}
        known["hosts"] = tuple(str(h) for h in raw.get("hosts") or ())
        try:
            return cls(**known)
        except TypeError as e:
            raise ValueError(f"timeline event: {e}") from None


_FIELDS = {f.name for f in fields(TimelineEvent)}
_KEPT = ("v", "kind", "host", "ts")  # in every line, whatever their value


def timeline_dir() -> Path:
    return paths.state_dir() / "timeline"


def host_file(host: str | None = None, root: Path | None = None) -> Path:
    """This host's (or `host`'s) timeline file."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", host or socket.gethostname()).lstrip(".") or "host"
    return (root or timeline_dir()) / f"{name}.jsonl"


def append(event: TimelineEvent, path: Path | None = None) -> bool:
    """Keep `event` in its host's timeline (`path`: another file). Never raises and never
    blocks: False when it could not be written."""
    path = path or host_file(event.host or None)
    line = json.dumps(event.to_json(), separators=(",", ":"), default=str) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        logs.append_capped(path, line.encode(), CAP, keep=1)
    except (OSError, ValueError):
        return False
    return True


def record(kind: str, **fields_: Any) -> TimelineEvent:
    """Append an event of this host (now) and return it: what the service and the node
    supervisor call at each change."""
    event = TimelineEvent(kind=kind, host=fields_.pop("host", None) or socket.gethostname(), **fields_)
    append(event)
    return event


def parse(lines: Iterable[str]) -> list[TimelineEvent]:
    """The events of timeline lines (a file's, or a file's text fetched from another host); a
    line that is not one (torn by a crash, another version) is skipped."""
    out = []
    for line in lines:
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            out.append(TimelineEvent.from_json(json.loads(line)))
    return out


def read(path: Path | None = None) -> list[TimelineEvent]:
    """One host's events (this host's by default), oldest first, its rotated file included."""
    return sorted(parse(logs.read_tail(path or host_file(), READ_CAP, keep=1)), key=lambda e: e.ts)


def read_dir(root: Path | None = None) -> list[TimelineEvent]:
    """Every host's file in one directory, merged."""
    root = root or timeline_dir()
    try:
        files = sorted(p for p in root.iterdir() if p.suffix == ".jsonl")
    except OSError:
        return []
    return merge(*(read(p) for p in files))


def merge(*streams: Iterable[TimelineEvent]) -> list[TimelineEvent]:
    """Events of several hosts (or several files of one) as one list, oldest first."""
    return sorted((e for s in streams for e in s), key=lambda e: e.ts)


@dataclass(frozen=True)
class Counted:
    """An event and its repeats: the latest of them, how many, and when the first was."""

    event: TimelineEvent
    count: int
    first: float

    def line(self) -> str:
        """`14:02:33 <sentence> (×5 since 13:40:02)`."""
        if self.count == 1:
            return self.event.line()
        return f"{self.event.line()} (×{self.count} since {time.strftime('%H:%M:%S', time.localtime(self.first))})"


def counted(events: Iterable[TimelineEvent]) -> list[Counted]:
    """Repeats folded (`TimelineEvent.key`): one entry per kind of event, by its latest time,
    oldest first."""
    by_key: dict[tuple, Counted] = {}
    for e in sorted(events, key=lambda e: e.ts):
        seen = by_key.pop(e.key(), None)
        by_key[e.key()] = Counted(e, seen.count + 1, seen.first) if seen else Counted(e, 1, e.ts)
    return list(by_key.values())
