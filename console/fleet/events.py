"""What happened on the hosts, in the console's memory and on disk: one vocabulary, the
timeline's (`store.timeline.TimelineEvent`: an action started or ended with its hosts, a step of
it, a host stale, unreachable or back with how long, a service registering, serving, failed with
its rank, host and reason, stopped or relaunched), each saying itself in a sentence.

`FleetLog` keeps what this console saw and did, per host, for its screens (listeners hear each
event as it comes); what only the console can know — a host going stale, unreachable and coming
back, a host left out, an action started and ended — it also appends to this host's timeline file,
where the services and nodes append their own. `gather` reads every host's timeline (this one's
from its files, another's over its own connection: `Host.timeline`) and merges them by time:
what `e` shows and `dsv4 fleet events` prints. Torch-free, no Textual.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from console.data.snapshot import LOCAL
from store import timeline as T
from store.timeline import TimelineEvent

KEPT = 500  # events kept in memory per host
# what only the console knows, kept on disk in this host's timeline (a service's own events are
# written by the service; an action's steps and lines stay in the console's log)
PERSISTED = frozenset({T.STARTED, T.ENDED, T.STALE, T.UNREACHABLE, T.BACK, T.LEFT_OUT, T.BROUGHT_BACK})


def on_disk(event: TimelineEvent) -> TimelineEvent:
    """`event` as this host's timeline keeps it: this host by its hostname, not a fleet of one's `local`."""
    name = socket.gethostname()

    def real(host: str) -> str:
        return name if host == LOCAL else host

    if event.host != LOCAL and LOCAL not in event.hosts:
        return event
    return dataclasses.replace(event, host=real(event.host), hosts=tuple(real(h) for h in event.hosts))


class FleetLog:
    """Every host's events as this console saw them, kept per host (the fleet's own under
    `store.timeline.FLEET`); listeners hear each one as it is added (the screens' logs, `dsv4
    fleet`'s output); the kinds only the console knows (PERSISTED) also go to this host's timeline
    file (`keep`). Thread-safe: the collector adds from its thread."""

    def __init__(self, keep: bool = True) -> None:
        self.by_host: dict[str, deque[TimelineEvent]] = {}
        self.listeners: list[Callable[[TimelineEvent], None]] = []
        self.keep = keep
        self._lock = threading.Lock()

    def add(self, event: TimelineEvent) -> TimelineEvent:
        with self._lock:
            self.by_host.setdefault(event.host, deque(maxlen=KEPT)).append(event)
            listeners = list(self.listeners)
        if self.keep and event.kind in PERSISTED:
            T.append(on_disk(event), T.host_file())  # never raises: a full disk must not stop the console
        for listen in listeners:
            listen(event)
        return event

    def say(self, kind: str, host: str = T.FLEET, **fields: Any) -> TimelineEvent:
        """Add an event of `kind` (now)."""
        return self.add(TimelineEvent(kind=kind, host=host, **fields))

    def events(self, host: str | None = None) -> list[TimelineEvent]:
        """One host's events (None: every host's, merged by time)."""
        with self._lock:
            if host is not None:
                return list(self.by_host.get(host, ()))
            streams = [list(s) for s in self.by_host.values()]
        return T.merge(*streams)

    def sentences(self) -> list[str]:
        return [e.sentence() for e in self.events()]


def unique(events: Iterable[TimelineEvent]) -> list[TimelineEvent]:
    """Events read twice (two hosts sharing a state directory, a file and its copy) once, in time order."""
    seen: set[str] = set()
    out = []
    for e in T.merge(events):
        key = repr(sorted(e.to_json().items()))
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out


async def gather(hosts: Mapping[str, Any]) -> tuple[list[TimelineEvent], dict[str, str]]:
    """Every host's timeline (`Host.timeline`: this host's files, another's over its connection),
    merged by time, and each host that could not say why; this host's own file is read once even
    when no host of the fleet is this one (the console's actions and what it saw of the hosts are
    kept there)."""
    names = list(hosts)
    answers = await asyncio.gather(*(hosts[n].timeline() for n in names), return_exceptions=True)
    streams: list[list[TimelineEvent]] = []
    problems: dict[str, str] = {}
    for name, answer in zip(names, answers, strict=True):
        if isinstance(answer, BaseException):
            problems[name] = str(answer) or type(answer).__name__
        else:
            streams.append(answer)
    if not any(getattr(h, "kind", "") == "local" for h in hosts.values()):
        streams.append(await asyncio.to_thread(T.read_dir))
    return unique(e for s in streams for e in s), problems


def lines(events: Iterable[TimelineEvent]) -> list[str]:
    """The timeline as a person reads it: repeats folded (`(×5 since 13:40:02)`), oldest first."""
    return [c.line() for c in T.counted(events)]
