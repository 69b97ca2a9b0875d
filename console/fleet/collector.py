"""Every host's reading, asked of all of them at once and waited for a bounded time: a fleet
snapshot (one host: the one-host console's). What changed since the last one is told to the
fleet log (`console.fleet.watch`). `--once` asks twice, about a second apart, as a live
service's rates need two scrapes, and the second time with each host's launch history.
Threads, not the console's event loop: a collection blocks; the console runs it off the UI.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from console.data.records import LaunchRecord
from console.data.snapshot import SCHEMA_VERSION
from console.fleet import events as E
from console.fleet.host import Host, HostReading
from console.fleet.watch import Transitions

ANSWER_S = 3.0  # a refresh waits this long for every asked host's answer
ONCE_GAP_S = 1.0  # --once: between the two scrapes of a live service's /metrics


@dataclass(frozen=True)
class FleetSnapshot:
    ts: float
    hosts: tuple[HostReading, ...]
    left_out: tuple[str, ...] = ()  # hosts the operator left out of the service

    def reading(self, host: str) -> HostReading | None:
        return next((r for r in self.hosts if r.host == host), None)

    def to_json(self) -> dict[str, Any]:
        from console.fleet.rows import drift

        return {"v": SCHEMA_VERSION, "ts": self.ts, "hosts": [h.to_json() for h in self.hosts],
                "left_out": list(self.left_out), "drift": {h: list(d) for h, d in drift(self.hosts).items()}}


class FleetCollector:
    """Every host's reading; `snapshot()` asks them and waits up to `answer` seconds."""

    def __init__(self, hosts: Sequence[Host], answer: float = ANSWER_S, log: E.FleetLog | None = None):
        self.hosts = {h.name: h for h in hosts}
        self.answer = answer
        self.log = log or E.FleetLog()
        self.changed = threading.Condition()
        self.transitions = Transitions()
        self.left_out: tuple[str, ...] = ()
        self.last: FleetSnapshot | None = None
        for h in hosts:
            h.on_change = self._changed

    def _changed(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def readings(self) -> tuple[HostReading, ...]:
        """What is known of every host now, asking nothing."""
        now = time.monotonic()
        return tuple(h.reading(now) for h in self.hosts.values())

    def snapshot(self, wait: float | None = None, history: bool = False,
                 only: Sequence[str] | None = None) -> FleetSnapshot:
        """Ask the hosts (`only` some of them) for a snapshot, wait for their answers, read all."""
        asked = [self.hosts[n] for n in only] if only is not None else list(self.hosts.values())
        for h in asked:
            h.ask(history)
        deadline = time.monotonic() + (self.answer if wait is None else wait)
        with self.changed:
            while any(h.pending() for h in asked) and (left := deadline - time.monotonic()) > 0:
                self.changed.wait(min(left, 0.5))
        return self._seen(self.readings())

    def _seen(self, readings: tuple[HostReading, ...]) -> FleetSnapshot:
        snap = FleetSnapshot(time.time(), readings, self.left_out)
        for event in self.transitions.see(readings):
            self.log.add(event)
        self.last = snap
        return snap

    def first(self, timeout: float) -> FleetSnapshot:
        """Every host's first answer, or why not, within `timeout`."""
        for h in self.hosts.values():
            h.ask()
        deadline = time.monotonic() + timeout
        with self.changed:
            while (left := deadline - time.monotonic()) > 0 and any(r.connecting or (r.snapshot is None and r.reachable)
                                                                    for r in self.readings()):
                for h in self.hosts.values():
                    h.ask()  # a stream that just connected answers its own first line; asking again is free
                self.changed.wait(min(left, 0.5))
        return self._seen(self.readings())

    def once(self, timeout: float, gap: float = ONCE_GAP_S) -> FleetSnapshot:
        """`--once`: every host's first answer, then (about a second later when a service runs
        somewhere: its rates need two scrapes) a second one carrying each host's launch history."""
        first = self.first(timeout)
        live = any(not v.ended for r in first.hosts if r.snapshot is not None for v in r.snapshot.services.services)
        time.sleep(gap if live else 0.25)
        answered = [r.host for r in first.hosts if r.snapshot is not None and r.reachable]
        return self.snapshot(history=True, only=answered) if answered else first

    def history(self, only: Sequence[str] | None = None) -> list[LaunchRecord]:
        """Every host's launch history, one record per launch (a launch's lines on several hosts
        merge by its service's identity), oldest first, each naming its host."""
        by_launch: dict[str, LaunchRecord] = {}
        self.snapshot(only=only)  # a request still being answered is answered first: each host hears the next
        for reading in self.snapshot(history=True, only=only).hosts:
            if only is not None and reading.host not in only:
                continue
            for record in reading.snapshot.history if reading.snapshot is not None else ():
                record = dataclasses.replace(record, host=record.host or reading.host)
                key = record.launch or f"{reading.host}/{record.started}"
                by_launch[key] = by_launch[key].merged(record) if key in by_launch else record
        return sorted(by_launch.values(), key=lambda r: r.started or 0)

    def close(self) -> None:
        for h in self.hosts.values():
            h.close()
