"""A fake host for tests (pyinfra's fake connector is the model): it records every command it is
given, in order and across hosts (`Ledger`), and answers from a script — exit code, stdout
lines (events as a real `dsv4` prints them), stderr, the bytes it writes into a pipe — so the
orchestration (node 0 first and its port relayed, the stop order, an import's source, a host
left out) is driven without root, sshd or a second machine. Its snapshots are given values; it
can go away and come back. Torch-free, no Textual.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from console.data.snapshot import Snapshot
from console.fleet.host import Host, HostReading, LogFeed, OnEvent, OnLine
from runtime.events import EventError, parse
from runtime.launch.spec import LaunchSpec


@dataclass(frozen=True, kw_only=True)
class Answer:
    """What a fake command does: its stdout lines, stderr lines, bytes into its stdout pipe, exit code."""

    code: int = 0
    lines: tuple[str, ...] = ()
    stderr: tuple[str, ...] = ()
    stdout: bytes = b""  # written into the pipe it was given as stdout (an export)
    delay: float = 0.0  # seconds it runs before answering

    @classmethod
    def record(cls, **record: Any) -> Answer:
        """A command printing one JSON record (`node start --json`)."""
        return cls(lines=(json.dumps(record),))


OK = Answer()
Script = Callable[["FakeHost", tuple[str, ...]], Answer] | Mapping[tuple[str, ...], Answer]


@dataclass
class Ledger:
    """Every command of every fake host, as it started and ended: (time, "start" | "end", host, args)."""

    entries: list[tuple[float, str, str, tuple[str, ...]]] = field(default_factory=list)

    def add(self, what: str, host: str, args: tuple[str, ...]) -> None:
        self.entries.append((time.monotonic(), what, host, args))

    def order(self, what: str = "start", word: str = "") -> list[str]:
        """The hosts in the order their commands (those whose args hold `word`) did `what`."""
        return [h for _, w, h, args in self.entries if w == what and (not word or word in args)]


class FakeCommand:
    """`console.fleet.command.Worker`'s face, played from an `Answer`."""

    def __init__(self, host: FakeHost, name: str, args: tuple[str, ...], on_event: OnEvent | None,
                 on_line: OnLine | None, stdin: int | None, stdout: int | None):
        self.host, self.name, self.args = host, name, args
        self.argv = ["dsv4", *args]
        self.on_event, self.on_line = on_event, on_line
        self.stdin = os.dup(stdin) if stdin is not None else None  # held as a process holds what it inherited
        self.stdout = os.dup(stdout) if stdout is not None else None
        self.stderr_tail: deque[str] = deque(maxlen=20)
        self.returncode: int | None = None
        self.stopping = False
        self.pid = 40000 + len(host.commands)
        self._started = False

    @property
    def running(self) -> bool:
        return self._started and self.returncode is None

    async def run(self) -> int:
        self._started = True
        host = self.host
        host.commands.append(self.args)
        host.ledger.add("start", host.name, self.args)
        if self.stdin is not None:
            host.received[self.args] = await asyncio.get_running_loop().run_in_executor(None, _read_all, self.stdin)
            self.stdin = None
        answer = host.answer(self.args)
        if answer.delay:
            await asyncio.sleep(answer.delay)
        if self.stdout is not None:
            with contextlib.suppress(OSError):
                os.write(self.stdout, answer.stdout)
            os.close(self.stdout)  # its reader sees the end
            self.stdout = None
        for line in answer.lines:
            try:
                event = parse(line) if line.startswith("{") else None
            except EventError:
                event = None
            if event is not None and self.on_event:
                self.on_event(self, event)
            elif self.on_line:
                self.on_line(self, "stdout", line)
        for line in answer.stderr:
            self.stderr_tail.append(line)
            if self.on_line:
                self.on_line(self, "stderr", line)
        self.returncode = answer.code
        host.ledger.add("end", host.name, self.args)
        return answer.code

    async def stop(self, timeout: float = 0.0) -> int | None:
        self.stopping = True
        return self.returncode


def _read_all(fd: int) -> bytes:
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


class ScriptedFeed(LogFeed):
    """A log whose lines are given (the script's answer to `service log`)."""

    def __init__(self, label: str, lines: Sequence[str], where: str):
        self.label, self.where, self._lines = label, where, list(lines)

    def poll(self) -> list[str]:
        out, self._lines = self._lines, []
        return out

    @property
    def running(self) -> bool:
        return bool(self._lines)  # a scripted log ends with its lines


class FakeHost(Host):
    kind = "fake"
    blocking = False  # its snapshots are given values: asked on the UI thread, screens stay deterministic

    def __init__(self, name: str, node_rank: int = 0, *, snapshots: Sequence[Snapshot] = (),
                 script: Script | None = None, ledger: Ledger | None = None, history: Sequence[Any] = ()):
        super().__init__(name, node_rank)
        self.snapshots = deque(snapshots)  # answered in turn; the last one keeps being answered
        self.latest: Snapshot | None = None
        self.history = tuple(history)  # what an ask with history carries
        self.script = script or {}
        self.ledger = ledger if ledger is not None else Ledger()
        self.commands: list[tuple[str, ...]] = []
        self.received: dict[tuple[str, ...], bytes] = {}  # what each command read from its stdin pipe
        self.watched: list[tuple[LaunchSpec, int | None]] = []
        self.away = ""  # why it cannot be reached ("" : it can)
        self.asks = 0
        self.received_at: float | None = None

    def answer(self, args: tuple[str, ...]) -> Answer:
        if callable(self.script):
            return self.script(self, args)
        for prefix, answer in sorted(self.script.items(), key=lambda kv: -len(kv[0])):
            if args[:len(prefix)] == prefix:
                return answer
        return OK

    def command(self, name: str, args: Sequence[str], *, on_event: OnEvent | None = None,
                on_line: OnLine | None = None, stdin: int | None = None, stdout: int | None = None,
                detach: bool = False) -> FakeCommand:
        return FakeCommand(self, name, tuple(args), on_event, on_line, stdin, stdout)

    def watch(self, spec: LaunchSpec, local_ranks: int | None = None) -> None:
        self.watched.append((spec, local_ranks))

    def ask(self, history: bool = False) -> None:
        import dataclasses

        self.asks += 1
        if self.away:
            return
        if self.snapshots:
            self.latest = self.snapshots.popleft() if len(self.snapshots) > 1 else self.snapshots[0]
            self.latest = dataclasses.replace(self.latest, host_name=self.name,
                                              history=self.history if history else ())
            self.received_at = time.monotonic()
        self.on_change()

    def pending(self) -> bool:
        return False

    def reading(self, now: float) -> HostReading:
        age = None if self.received_at is None else now - self.received_at
        return HostReading(host=self.name, node_rank=self.node_rank, reachable=not self.away, error=self.away,
                           snapshot=self.latest, age_s=age, fresh=not self.away and self.latest is not None, took_s=0.0)

    def go_away(self, why: str = "connection refused") -> None:
        self.away = why

    def come_back(self) -> None:
        self.away = ""

    def log(self, label: str, *, pid: int | None = None, rank: int | None = None, node: int | None = None,
            follow: bool = True, previous: bool = False) -> LogFeed:
        from console.data.logs import log_args

        args = ("service", "log", *log_args(pid, rank, node, previous))
        self.commands.append(args)
        feed = ScriptedFeed(label, self.answer(args).lines, " ".join(args))
        feed.host_name = self.name
        return feed
