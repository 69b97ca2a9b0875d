"""Worker processes: every long action runs as a `dsv4 …` subprocess driven from asyncio.

stdout lines that parse as runtime.events become events; every other line (and stderr) is a
log line. The last stderr lines are kept so a failure can say why; a worker that exits
non-zero ends with an `error` event made on the parent's side (exit code, last stderr lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import signal
import sys
from collections import Counter, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual.message import Message

from runtime.events import Event, EventError, parse

STDERR_TAIL = 20
STOP_TIMEOUT = 10.0


# `path/to/module.py:123: FutureWarning: text`, as Python's warnings module prints it
_WARNING = re.compile(r"^(?P<file>\S+?):(?P<line>\d+): (?P<cat>\w*Warning): (?P<msg>.*)$")


class LineFilter:
    """Library warnings from workers, one line each: `FutureWarning: text (module.py:123)`.

    The source line Python echoes under a warning is dropped, and a warning already shown is
    not shown again (torch repeats the same FutureWarning for every compiled program)."""

    def __init__(self) -> None:
        self.seen: Counter[tuple[str, str]] = Counter()
        self._under_warning = False

    def __call__(self, line: str) -> list[str]:
        m = _WARNING.match(line)
        if m:
            key = (m["cat"], m["msg"])
            self.seen[key] += 1
            self._under_warning = True
            if self.seen[key] > 1:
                return []
            return [f"{m['cat']}: {m['msg']} ({Path(m['file']).name}:{m['line']})"]
        if self._under_warning and line.startswith("  "):
            return []
        self._under_warning = False
        return [line]


def dsv4(*args: str) -> list[str]:
    """argv of a `dsv4` subcommand run by this interpreter (no reliance on PATH)."""
    return [sys.executable, "-m", "console.cli", *args]


def service_argv(*args: str) -> list[str]:
    """argv of `dsv4 serve …` run by this interpreter through the `dsv4` script installed beside
    it, so the service's command line says `dsv4 serve` (`pgrep -f "dsv4 serve"` finds it);
    through `-m console.cli` where no script is installed."""
    script = Path(sys.executable).parent / "dsv4"
    return [sys.executable, str(script), "serve", *args] if script.is_file() else dsv4("serve", *args)


def shown(argv: list[str]) -> str:
    """A `dsv4(...)` or `service_argv(...)` argv as a person would type it in a shell:
    `dsv4 serve /models/x --ranks 2`."""
    rest = argv[3:] if argv[1:3] == ["-m", "console.cli"] else argv[2:]
    return shlex.join(["dsv4", *rest])


class Worker:
    """One subprocess; `run()` streams it to the callbacks until it exits."""

    def __init__(self, name: str, argv: list[str], *, on_event: Callable[[Worker, Event], None],
                 on_line: Callable[[Worker, str, str], None], detach: bool = False):
        self.name, self.argv = name, argv
        self.on_event, self.on_line = on_event, on_line
        self.detach = detach  # own session: survives the console when the operator leaves it running
        self.proc: asyncio.subprocess.Process | None = None
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self.returncode: int | None = None
        self.stopping = False
        self._filter = LineFilter()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.returncode is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def run(self) -> int:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=self.detach,
                limit=1 << 20)
        except OSError as e:
            self.returncode = 127
            self.on_event(self, self.failure(f"cannot start: {e}"))
            return self.returncode
        await asyncio.gather(self._pump(self.proc.stdout, "stdout"), self._pump(self.proc.stderr, "stderr"))
        self.returncode = await self.proc.wait()
        if self.returncode != 0 and not self.stopping:  # stopped on request: any exit is the expected one
            self.on_event(self, self.failure(f"exit code {self.returncode}"))
        return self.returncode

    def failure(self, why: str) -> Event:
        last = self.stderr_tail[-1] if self.stderr_tail else ""
        return Event(self.name, "error", message=f"{self.name}: {why}" + (f": {last}" if last else ""),
                     detail={"exit_code": self.returncode, "stderr": list(self.stderr_tail)})

    async def _pump(self, stream: asyncio.StreamReader | None, which: str) -> None:
        if stream is None:
            return
        while True:
            try:
                raw = await stream.readline()
            except ValueError:  # a line over the limit: skip it, keep streaming
                continue
            if not raw:
                return
            line = raw.decode(errors="replace").rstrip("\r\n")
            if which == "stdout" and line.startswith("{"):
                try:
                    self.on_event(self, parse(line))
                    continue
                except EventError:
                    pass
            if which == "stderr" and line.strip():
                self.stderr_tail.append(line)
            for shown in self._filter(line):
                self.on_line(self, which, shown)

    async def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM (the service drains and exits 0), then SIGKILL after `timeout`."""
        if not self.running or self.proc is None:
            return self.returncode
        self.stopping = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        return self.proc.returncode


class WorkerEvent(Message):
    """An event from a worker process (a job, or the service this console holds)."""

    def __init__(self, worker: Any, event: Event) -> None:
        super().__init__()
        self.worker, self.event = worker, event


class WorkerLine(Message):
    """A log line from a worker process."""

    def __init__(self, worker: Any, which: str, line: str) -> None:
        super().__init__()
        self.worker, self.which, self.line = worker, which, line
