"""A host over ssh, as a Host: every command it runs (actions, snapshots, logs) goes through the
system `ssh` with one shared connection to it (`console.fleet.ssh`: ControlMaster, the
operator's options first), and every failure says what it means in one line.

Its snapshots come from one `dsv4 snapshot --stream` kept open: asked for a fresh one at each
refresh (a line on its stdin), answering with one JSON line. A host that cannot be reached, or
stops answering, is a reading that says why and since when, keeping what was last known — never
the last snapshot passed off as fresh. A stream that ends is started again after a pause that
grows while the host stays away. Threads, not the console's event loop: a stream blocks on its
pipe and costs nothing while idle.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from console.data.logs import log_args
from console.data.snapshot import Snapshot, SnapshotVersionError
from console.fleet.command import Worker
from console.fleet.host import CommandFeed, Host, HostReading, LogFeed, OnEvent, OnLine
from console.fleet.spec import FleetHost
from console.fleet.ssh import Ssh, why
from runtime.launch.spec import CONSOLE, LaunchSpec

STALE_S = 6.0  # a host that has not answered a request for this long is stale, said so
RETRY_S = (2.0, 5.0, 10.0, 30.0)  # pauses before starting a stream again, while it keeps failing
MAX_LINE = 16 << 20  # a snapshot line larger than this is not one


def _ignore(*_: Any) -> None:
    pass


class SshHost(Host):
    kind = "ssh"

    def __init__(self, host: FleetHost, ssh: Ssh):
        super().__init__(host.name, host.node_rank)
        self.host, self.ssh = host, ssh
        self.stream: HostStream | None = None
        self.watched: list[str] | None = None
        self.last: Snapshot | None = None  # kept across streams: what was last known

    @property
    def where(self) -> str:
        return f"{self.name} over ssh"

    @property
    def rendezvous(self) -> str:
        return self.host.rendezvous

    def argv(self, args: Sequence[str]) -> list[str]:
        """The command line that runs `dsv4 ARGS` there (the one place ssh's argv is made)."""
        return self.ssh.argv(self.host, *args)

    def command(self, name: str, args: Sequence[str], *, on_event: OnEvent | None = None,
                on_line: OnLine | None = None, stdin: int | None = None, stdout: int | None = None,
                detach: bool = False) -> Worker:
        return Worker(name, self.argv(args), on_event=on_event or _ignore, on_line=on_line or _ignore, stdin=stdin,
                      stdout=stdout, detach=detach)

    def why(self, code: int | None, stderr: Sequence[str]) -> str:
        return why(self.host, code, list(stderr))

    def watch(self, spec: LaunchSpec, local_ranks: int | None = None) -> None:
        args = ["snapshot", "--stream", *spec.argv(CONSOLE)]
        if local_ranks is not None:
            args += ["--local-ranks", str(local_ranks)]
        if args == self.watched:
            return
        if self.stream is not None:
            self.last = self.stream.snapshot or self.last
            self.stream.stop()
        self.watched = args
        self.stream = HostStream(self, self.argv(args), self.last)
        self.stream.start()

    def ask(self, history: bool = False) -> None:
        if self.stream is not None:
            self.stream.request("history" if history else "")

    def pending(self) -> bool:
        s = self.stream
        return s is not None and s.proc is not None and s.answered < s.asked

    def reading(self, now: float) -> HostReading:
        if self.stream is None:
            return HostReading(host=self.name, node_rank=self.node_rank, reachable=False, error="not watched yet")
        return self.stream.reading(now)

    def log(self, label: str, *, pid: int | None = None, rank: int | None = None, node: int | None = None,
            follow: bool = True, previous: bool = False) -> LogFeed:
        return CommandFeed(self, label, ("service", "log", *log_args(pid, rank, node, previous),
                                                  *(("--follow",) if follow and not previous else ())))

    def close(self) -> None:
        if self.stream is not None:
            self.stream.stop()
        self.ssh.close(self.host)


class HostStream:
    """`dsv4 snapshot --stream` on one host, restarted when it ends."""

    def __init__(self, owner: SshHost, argv: list[str], last: Snapshot | None = None):
        self.owner, self.argv = owner, argv
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.snapshot: Snapshot | None = last  # the latest (kept while the host is away)
        self.received: float | None = None  # monotonic time of the latest answer
        self.asked = self.answered = 0
        self.asked_at = time.monotonic()
        self.error = "connecting"
        self.reachable = False
        self.took: float | None = None
        self.failures = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"fleet-{owner.name}", daemon=True)

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
            fresh = self.reachable and self.answered >= self.asked and self.snapshot is not None and not self.error
            age = None if self.received is None else now - self.received
            error = self.error
            if error == "connecting" and now - self.asked_at > STALE_S:
                error = f"no answer within {now - self.asked_at:.0f} s (ssh still connecting, or dsv4 starting)"
            if self.reachable and self.answered < self.asked and now - self.asked_at > STALE_S:
                last = f"last snapshot {age:.0f} s ago" if age is not None else "no snapshot yet"
                error = f"no answer for {now - self.asked_at:.0f} s ({last})"
            owner = self.owner
            return HostReading(host=owner.name, node_rank=owner.node_rank, reachable=self.reachable, error=error,
                               snapshot=self.snapshot, age_s=age, fresh=fresh, took_s=self.took,
                               connecting=self.error == "connecting" and self.failures == 0)

    def _run(self) -> None:
        while not self.stopped.is_set():
            self._stream()
            if self.stopped.is_set():
                return
            self.failures += 1
            self.owner.on_change()
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
                self.error = self.owner.why(code, list(stderr))

    def _answer(self, raw: bytes) -> None:
        now = time.monotonic()
        try:
            snap, error = Snapshot.from_json(json.loads(raw), self.owner.name), ""
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
        self.owner.on_change()

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
