"""The service a console holds, followed by its identity (`store.services.Service`), never by a
pipe: one the console's `l` launched (`dsv4 service start`: detached, under its own supervisor)
or one found running at start and re-attached — the same way for both. Its events and output are
read by tailing their files, so the service neither dies with the console nor of a broken pipe,
and "Leave running" leaves it running for real. How it ended is its registry record's to say
(the service's own words, or its supervisor's for a signal): this console is not its parent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import deque
from collections.abc import Callable
from pathlib import Path

from console.tui.workers import STDERR_TAIL, LineFilter
from runtime.events import Event, EventError, parse
from store import services

POLL = 0.2  # seconds between tail reads: fast enough for a progress bar, idle otherwise


class Detached:
    """A command's face (`console.fleet.command.Worker`'s: name, pid, running, run) over a service
    this console does not hold by a pipe; it is stopped through its host (`dsv4 service stop`)."""

    def __init__(self, service: services.Service, *, on_event: Callable[[Detached, Event], None],
                 on_line: Callable[[Detached, str, str], None], fresh: bool = False, name: str = "launch"):
        """`fresh`: launched just now (its output from the start); else re-attached (only what
        it writes from now on: its past is in the history)."""
        self.name, self.service, self.fresh = name, service, fresh
        self.on_event, self.on_line = on_event, on_line
        self.log = Path(service.log) if service.log else Path()
        self.events = Path(service.events) if service.events else Path()
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self.returncode: int | None = None  # never known here: the registry's ending says how it ended
        self.started: float | None = service.create_time  # the process's start time
        self._filter = LineFilter()

    @property
    def pid(self) -> int:
        return self.service.pid

    @property
    def identity(self) -> services.ServiceId:
        """Which service this is (host, pid and start time)."""
        return self.service.identity

    @property
    def log_path(self) -> str:
        """Its log ("" for none known): its own capped log file, else its output."""
        return self.service.log_file or ("" if str(self.log) in ("", ".") else str(self.log))

    @property
    def running(self) -> bool:
        return services.is_current(self.service)

    async def run(self) -> None:
        """Follow its events and output until its process is gone."""
        await asyncio.gather(self._tail(self.events, "events", skip_existing=False),
                             self._tail(self.log, "log", skip_existing=not self.fresh))

    async def _tail(self, path: Path, which: str, *, skip_existing: bool) -> None:
        if not str(path) or path == Path():
            while self.running:
                await asyncio.sleep(POLL)
            return
        f = None
        try:
            while True:
                if f is None:
                    with contextlib.suppress(OSError):
                        f = open(path, "rb")  # noqa: SIM115 - held across awaits
                        if skip_existing:
                            f.seek(0, os.SEEK_END)
                if f is not None:
                    self._drain(f, which)
                if not self.running:
                    if f is not None:
                        self._drain(f, which, final=True)
                    return
                await asyncio.sleep(POLL)
        finally:
            if f is not None:
                f.close()

    def _drain(self, f, which: str, final: bool = False) -> None:
        while True:
            pos = f.tell()
            raw = f.readline()
            if not raw:
                return
            if not raw.endswith(b"\n") and not final:
                f.seek(pos)  # a line still being written: read it whole next time
                return
            line = raw.decode(errors="replace").rstrip("\r\n")
            if which == "events":
                with contextlib.suppress(EventError):
                    self.on_event(self, parse(line))
                continue
            if line.strip():
                self.stderr_tail.append(line)
            for shown in self._filter(line):
                self.on_line(self, "stderr", shown)
