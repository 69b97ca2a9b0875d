"""What changed between two fleet snapshots, as events: a host going stale or unreachable and
coming back (with how long it was away), a service registering, serving, failing (its rank,
host and own reason) or stopping. A pure function of the readings the collector makes, so the
fleet log says what happened without anyone watching the screen. Torch-free, no Textual."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from console.fleet.host import HostReading
from store import timeline as T

STOPPED_WORDS = ("stopped",)  # how a service that was asked to stop says it ended (`store.services.how`)


@dataclass
class _Host:
    state: str = ""  # fresh | stale | unreachable ("" : not seen yet)
    since: float = 0.0  # wall time it entered that state
    services: dict[str, str] = field(default_factory=dict)  # identity key → state (registering, serving, …)
    seen: bool = False  # its services were read once (what ran before the console came is not news)


class Transitions:
    """Feed it each fleet snapshot (`see`): the events since the one before."""

    def __init__(self) -> None:
        self.hosts: dict[str, _Host] = {}

    def see(self, readings: tuple[HostReading, ...], now: float | None = None) -> list[T.TimelineEvent]:
        now = time.time() if now is None else now
        out: list[T.TimelineEvent] = []
        for r in readings:
            known = self.hosts.setdefault(r.host, _Host())
            out += self._reach(r, known, now)
            if r.fresh and r.snapshot is not None:
                out += self._services(r, known, now)
        return out

    def _reach(self, r: HostReading, known: _Host, now: float) -> list[T.TimelineEvent]:
        if r.connecting:
            return []
        state = r.state
        if state == known.state:
            return []
        was, since = known.state, known.since
        known.state, known.since = state, now
        if state == "fresh":
            return [T.TimelineEvent(kind=T.BACK, host=r.host, ts=now, seconds=now - since)] if was else []
        kind = T.UNREACHABLE if state == "unreachable" else T.STALE
        return [T.TimelineEvent(kind=kind, host=r.host, ts=now, text=r.error or state)]

    def _services(self, r: HostReading, known: _Host, now: float) -> list[T.TimelineEvent]:
        out = []
        for view in r.snapshot.services.services:
            key, state = view.identity.key, view.state
            if known.services.get(key) == state:
                continue
            known.services[key] = state
            if not known.seen and view.ended:
                continue  # what ended before this console came is history, not news
            if (event := _service_event(r.host, view, now)) is not None:
                out.append(event)
        known.seen = True
        return out


def _service_event(host: str, view, now: float) -> T.TimelineEvent | None:
    state = view.state
    if state == "registering":
        phase = view.detail.phase if view.detail is not None else ""
        return T.TimelineEvent(kind=T.REGISTERING, host=host, ts=now, pid=view.pid, text=phase)
    if state == "serving":
        return T.TimelineEvent(kind=T.SERVING, host=host, ts=now, pid=view.pid, url=view.url)
    if state == "failed":
        lost = next((rk for rk in view.ranks if rk.error), None)
        reason = (view.detail.reason if view.detail is not None else "") or (lost.error if lost else "")
        if lost is not None and f"rank {lost.rank}" not in reason:  # name the rank and its host, once
            reason = f"rank {lost.rank}" + (f" on {lost.host}" if lost.host else "") + f": {reason}"
        return T.TimelineEvent(kind=T.FAILED, host=host, ts=now, pid=view.pid, rank=lost.rank if lost else None,
                            text=reason)
    if view.ended:
        ending = view.record.ending
        how = ending.how if ending else "ended"
        if how.startswith(STOPPED_WORDS):
            return T.TimelineEvent(kind=T.STOPPED, host=host, ts=now, pid=view.pid, text=how)
        said = f"{how} during {ending.phase}" if ending and ending.phase else how
        return T.TimelineEvent(kind=T.FAILED, host=host, ts=now, pid=view.pid,
                            text=f"{said}: {ending.error}" if ending and ending.error else said)
    return None
