"""A command running on a host: a `dsv4 …` process (on this host, or `ssh` running it on
another) driven from asyncio — what every action of every host runs through (`Host.command`).

stdout lines that parse as runtime.events become events; every other line (and stderr) is a
log line. The last stderr lines are kept so a failure can say why; a command that exits
non-zero ends with an `error` event made on the parent's side (exit code, last stderr lines).
Its stdin and stdout may be pipes of another command's (an export piped into an import, the
bytes never passing through the console). Torch-free, no Textual.
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
                 on_line: Callable[[Worker, str, str], None], detach: bool = False, stdin: int | None = None,
                 stdout: int | None = None):
        self.name, self.argv = name, argv
        self.on_event, self.on_line = on_event, on_line
        self.detach = detach  # own session: survives the console when the operator leaves it running
        # the ends of pipes it reads from and writes to (None: none / its own pipe to us), held as
        # a process holds what it inherited: the caller may close its own ends once this exists
        self.stdin = os.dup(stdin) if stdin is not None else None
        self.stdout = os.dup(stdout) if stdout is not None else None
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
                *self.argv, stdin=asyncio.subprocess.DEVNULL if self.stdin is None else self.stdin,
                stdout=asyncio.subprocess.PIPE if self.stdout is None else self.stdout,
                stderr=asyncio.subprocess.PIPE, env=env, start_new_session=self.detach, limit=1 << 20)
        except OSError as e:
            self.returncode = 127
            self.on_event(self, self.failure(f"cannot start: {e}"))
            return self.returncode
        finally:
            self.close_pipes()  # the process has its own copies (or none started: nothing reads them)
        await asyncio.gather(self._pump(self.proc.stdout, "stdout"), self._pump(self.proc.stderr, "stderr"))
        self.returncode = await self.proc.wait()
        if self.returncode != 0 and not self.stopping:  # stopped on request: any exit is the expected one
            self.on_event(self, self.failure(f"exit code {self.returncode}"))
        return self.returncode

    def close_pipes(self) -> None:
        for fd in (self.stdin, self.stdout):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.stdin = self.stdout = None

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
