"""Every host's snapshot, over SSH: one `dsv4 snapshot --stream` per host, kept open on a shared
connection, asked for a fresh snapshot at each refresh (a line on its stdin) and answering with
one JSON line. A host that cannot be reached, or stops answering, is a reading that says why and
since when — never the last snapshot passed off as fresh. A stream that ends is started again
after a pause that grows while the host stays away.

Threads, not the console's event loop: each stream blocks on its pipe and costs nothing while
idle; the console's refresh (off the UI thread) asks them all and waits a bounded time.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from console.data.records import LaunchRecord
from console.data.snapshot import SCHEMA_VERSION, Snapshot, SnapshotVersionError
from console.fleet.spec import Fleet, FleetHost
from console.fleet.ssh import Ssh, why
from runtime.launch.spec import CONSOLE, LaunchSpec

ANSWER_S = 3.0  # a refresh waits this long for every connected host's answer
STALE_S = 6.0  # a host that has not answered a request for this long is stale, said so
RETRY_S = (2.0, 5.0, 10.0, 30.0)  # pauses before starting a stream again, while it keeps failing
MAX_LINE = 16 << 20  # a snapshot line larger than this is not one


@dataclass(frozen=True)
class HostReading:
    """One host as the fleet sees it now."""

    host: str
    node_rank: int
    reachable: bool
    error: str = ""  # why it is not reachable, or why its snapshot is not fresh
    snapshot: Snapshot | None = None  # its latest snapshot (stale when `fresh` is False)
    age_s: float | None = None  # seconds since that snapshot arrived
    fresh: bool = False  # it answered the latest request
    took_s: float | None = None  # the latest answer's round trip

    def to_json(self) -> dict[str, Any]:
        """`host` (its name in the fleet), `reachable`, `error`, and the host's snapshot under one
        host's --once --json keys — but for that snapshot's own `host` part (CPU, memory, load),
        which is `host_stats` here."""
        snap = self.snapshot.to_json() if self.snapshot else {}
        if "host" in snap:
            snap["host_stats"] = snap.pop("host")
        return {**snap, "host": self.host, "node_rank": self.node_rank, "reachable": self.reachable,
                "error": self.error, "fresh": self.fresh, "age_s": None if self.age_s is None else round(self.age_s, 2)}


@dataclass(frozen=True)
class FleetSnapshot:
    ts: float
    hosts: tuple[HostReading, ...]

    def to_json(self) -> dict[str, Any]:
        from console.fleet.rows import drift

        return {"v": SCHEMA_VERSION, "ts": self.ts, "hosts": [h.to_json() for h in self.hosts],
                "drift": {h: list(d) for h, d in drift(self.hosts).items()}}


class HostStream:
    """`dsv4 snapshot --stream` on one host, restarted when it ends."""

    def __init__(self, host: FleetHost, argv: list[str], on_change: Callable[[], None]):
        self.host, self.argv, self.on_change = host, argv, on_change
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.snapshot: Snapshot | None = None
        self.received: float | None = None  # monotonic time of the latest answer
        self.asked = self.answered = 0
        self.asked_at = time.monotonic()
        self.error = "connecting"
        self.reachable = False
        self.took: float | None = None
        self.failures = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"fleet-{host.name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def request(self, what: str = "") -> None:
        """Ask for a fresh snapshot (`history`: with the launch history); nothing to ask while
        the stream is down (it says why) or still answering."""
        with self.lock:
            proc = self.proc
            if proc is None or proc.stdin is None or proc.poll() is not None:
                return
            if self.answered < self.asked:
                return  # still answering the last request: asking again only queues work there
            self.asked += 1
            self.asked_at = time.monotonic()
        try:
            proc.stdin.write(what.encode() + b"\n")
            proc.stdin.flush()
        except (OSError, ValueError):
            pass  # the stream is ending: its reader says why

    def reading(self, now: float) -> HostReading:
        with self.lock:
            fresh = self.reachable and self.answered >= self.asked and self.snapshot is not None
            age = None if self.received is None else now - self.received
            error = self.error
            if error == "connecting" and now - self.asked_at > STALE_S:
                error = f"no answer within {now - self.asked_at:.0f} s (ssh still connecting, or dsv4 starting)"
            if self.reachable and not fresh and now - self.asked_at > STALE_S:
                last = f"last snapshot {age:.0f} s ago" if age is not None else "no snapshot yet"
                error = f"no answer for {now - self.asked_at:.0f} s ({last})"
            return HostReading(self.host.name, self.host.node_rank, self.reachable, error, self.snapshot, age,
                               fresh, self.took)

    def _run(self) -> None:
        while not self.stopped.is_set():
            self._stream()
            if self.stopped.is_set():
                return
            self.failures += 1
            self.on_change()
            self.stopped.wait(RETRY_S[min(self.failures, len(RETRY_S)) - 1])

    def _stream(self) -> None:
        stderr: deque[str] = deque(maxlen=20)
        try:
            proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            with self.lock:
                self.reachable, self.error = False, f"cannot run ssh: {e.strerror or e}"
            return
        with self.lock:
            self.proc, self.asked, self.answered, self.asked_at = proc, 1, 0, time.monotonic()
        reader = threading.Thread(target=lambda: stderr.extend(
            line.decode(errors="replace").rstrip() for line in proc.stderr), daemon=True)  # type: ignore[union-attr]
        reader.start()
        assert proc.stdout is not None
        for raw in iter(lambda: proc.stdout.readline(MAX_LINE), b""):
            self._answer(raw)
        code = proc.wait()
        reader.join(timeout=2)
        with self.lock:
            self.proc = None
            if not self.stopped.is_set():
                self.reachable = False
                self.error = why(self.host, code, list(stderr))

    def _answer(self, raw: bytes) -> None:
        now = time.monotonic()
        try:
            snap, error = Snapshot.from_json(json.loads(raw), self.host.name), ""
        except SnapshotVersionError as e:
            snap, error = None, str(e)
        except Exception as e:  # whatever a host sends: a reading that says so, never a crash here
            snap, error = None, f"not a snapshot ({type(e).__name__}: {str(e)[:120]})"
        with self.lock:
            self.answered += 1
            self.took = now - self.asked_at
            self.reachable, self.error, self.failures = True, error, 0
            if snap is not None:
                self.snapshot, self.received = snap, now
            elif error:
                self.snapshot = None
        self.on_change()

    def stop(self) -> None:
        self.stopped.set()
        with self.lock:
            proc = self.proc
        if proc is not None:
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.close()  # type: ignore[union-attr]  # the remote snapshot ends at EOF
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class FleetCollector:
    """Every host's reading; `snapshot()` asks them all and waits up to `answer` seconds."""

    def __init__(self, fleet: Fleet, spec: LaunchSpec, ssh: Ssh, answer: float = ANSWER_S):
        self.fleet, self.spec, self.ssh, self.answer = fleet, spec, ssh, answer
        self.changed = threading.Condition()
        remote = ["snapshot", "--stream", *spec.argv(CONSOLE)]
        self.streams = {h.name: HostStream(h, ssh.argv(h, *remote), self._changed) for h in fleet.hosts}
        for s in self.streams.values():
            s.start()

    def _changed(self) -> None:
        with self.changed:
            self.changed.notify_all()

    def _pending(self) -> list[HostStream]:
        return [s for s in self.streams.values() if s.proc is not None and s.answered < s.asked]

    def snapshot(self, wait: float | None = None, what: str = "") -> FleetSnapshot:
        for s in self.streams.values():
            s.request(what)
        deadline = time.monotonic() + (self.answer if wait is None else wait)
        with self.changed:
            while self._pending() and (left := deadline - time.monotonic()) > 0:
                self.changed.wait(min(left, 0.5))
        now = time.monotonic()
        return FleetSnapshot(time.time(), tuple(s.reading(now) for s in self.streams.values()))

    def history(self) -> list[LaunchRecord]:
        """Every host's launch history, one record per launch (a launch's lines on several hosts
        merge by its service's identity), oldest first, each naming its host."""
        import dataclasses

        by_launch: dict[str, LaunchRecord] = {}
        self.snapshot()  # a request still being answered is answered first: each host hears this one
        for reading in self.snapshot(what="history").hosts:
            for record in reading.snapshot.history if reading.snapshot is not None else ():
                record = dataclasses.replace(record, host=record.host or reading.host)
                key = record.launch or f"{reading.host}/{record.started}"
                by_launch[key] = by_launch[key].merged(record) if key in by_launch else record
        return sorted(by_launch.values(), key=lambda r: r.started or 0)

    def first(self, timeout: float) -> FleetSnapshot:
        """Every host's first answer, or why not, within `timeout` (for --once)."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while (left := deadline - time.monotonic()) > 0 and any(
                    s.error == "connecting" and s.failures == 0 for s in self.streams.values()):
                self.changed.wait(min(left, 0.5))
        now = time.monotonic()
        return FleetSnapshot(time.time(), tuple(s.reading(now) for s in self.streams.values()))

    def close(self) -> None:
        for s in self.streams.values():
            s.stop()
        for h in self.fleet.hosts:
            self.ssh.close(h)


@dataclass
class FleetSetup:
    """What a fleet console runs with: the fleet, the launch every host shares, ssh, the
    collector of every host's snapshots, and the registry `pull` uses."""

    fleet: Fleet
    spec: LaunchSpec
    ssh: Ssh
    collector: FleetCollector
    registry: str = ""
    insecure: bool = False

    @classmethod
    def start(cls, fleet: Fleet, spec: LaunchSpec, ssh: Ssh, **kw: Any) -> FleetSetup:
        return cls(fleet, spec, ssh, FleetCollector(fleet, spec, ssh), **kw)

    def close(self) -> None:
        self.collector.close()


class HostCollectors:
    """The one-host panes' collectors for a fleet host: its latest snapshot (asked for afresh
    at each refresh), nothing collected here."""

    inline = False

    def __init__(self, collector: FleetCollector, host: str):
        self.collector, self.host = collector, host
        self.stream = collector.streams[host]

    @property
    def device_kind(self) -> str:
        snap = self.stream.snapshot
        return snap.settings.device if snap is not None else "?"

    def snapshot(self) -> Snapshot:
        self.stream.request()
        deadline = time.monotonic() + self.collector.answer
        with self.collector.changed:
            while self.stream.answered < self.stream.asked and (left := deadline - time.monotonic()) > 0:
                self.collector.changed.wait(min(left, 0.5))
        reading = self.stream.reading(time.monotonic())
        if reading.snapshot is None:
            raise RuntimeError(f"{self.host}: {reading.error or 'no snapshot yet'}")
        return reading.snapshot

    def history(self) -> list[LaunchRecord]:
        return []

    def plan(self) -> tuple[Any, Any]:
        snap = self.stream.snapshot
        return None, snap.plan if snap is not None else None
