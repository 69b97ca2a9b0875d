"""A service process the console does not hold by a pipe: started detached (own session, its
output in files under the state dir) or found running at start and re-attached.

Why not `asyncio.create_subprocess_exec`: its transport kills a still-running child when it is
closed (at the console's exit), and a child writing into the console's pipe dies of SIGPIPE
once the console is gone. A `Popen` with file output survives both, so "Leave running" is
real. Events and log lines are read by tailing the files, the same way for a child and for a
service an earlier console (or a shell) started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
from collections import deque
from collections.abc import Callable
from pathlib import Path

import psutil

from console.tui.workers import STDERR_TAIL, STOP_TIMEOUT, LineFilter
from runtime.events import Event, EventError, parse
from store import services

POLL = 0.2  # seconds between tail reads: fast enough for a progress bar, idle otherwise


class Detached:
    """Same face as `console.tui.workers.Worker` (name, pid, running, run, stop, failure)."""

    def __init__(self, name: str, argv: list[str], *, on_event: Callable[[Detached, Event], None],
                 on_line: Callable[[Detached, str, str], None], log: Path, events: Path,
                 service: services.Service | None = None):
        self.name, self.argv = name, argv
        self.on_event, self.on_line = on_event, on_line
        self.log, self.events = log, events
        self.service = service  # set when attached to a running service (no child of ours)
        self.proc: subprocess.Popen | None = None
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL)
        self.returncode: int | None = None
        self.stopping = False
        self.started: float | None = service.create_time if service else None  # the process's start time
        self._filter = LineFilter()

    @classmethod
    def attach(cls, service: services.Service, **callbacks) -> Detached:
        return cls("launch", list(service.cmdline), log=Path(service.log) if service.log else Path(),
                   events=Path(service.events) if service.events else Path(), service=service, **callbacks)

    @property
    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid
        return self.service.pid if self.service else None

    @property
    def identity(self) -> services.ServiceId | None:
        """Which service this is (host, pid and start time), once it has a process."""
        if self.service is not None:
            return self.service.identity
        if self.pid is None or self.started is None:
            return None
        return services.ServiceId(socket.gethostname(), self.pid, round(self.started, 2))

    @property
    def log_path(self) -> str:
        """The log file ("" for none known)."""
        return "" if str(self.log) in ("", ".") else str(self.log)

    @property
    def running(self) -> bool:
        if self.returncode is not None:
            return False
        return not self._exited()

    def _exited(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is not None
        return self.service is None or not services.is_current(self.service)

    async def run(self) -> int:
        if self.service is None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            try:
                with open(self.log, "ab") as out:
                    self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                                 stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                                 close_fds=True)
                with contextlib.suppress(psutil.Error):
                    self.started = psutil.Process(self.proc.pid).create_time()
            except OSError as e:
                self.returncode = 127
                self.on_event(self, self.failure(f"cannot start: {e}"))
                return self.returncode
        # an attached service: show only what it writes from now on (its past is in the history)
        skip = self.service is not None
        await asyncio.gather(self._tail(self.events, "events", skip_existing=False),
                             self._tail(self.log, "log", skip_existing=skip))
        # not our child: its exit status is not ours to read (None); the service's ending says it
        self.returncode = self.proc.wait() if self.proc is not None else None
        return self.returncode

    async def _tail(self, path: Path, which: str, *, skip_existing: bool) -> None:
        if not str(path) or path == Path():
            while not self._exited():
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
                if self._exited():
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

    def failure(self, why: str) -> Event:
        last = self.stderr_tail[-1] if self.stderr_tail else ""
        return Event(self.name, "error", message=f"{self.name}: {why}" + (f": {last}" if last else ""),
                     detail={"exit_code": self.returncode, "stderr": list(self.stderr_tail)})

    def _signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
        elif self.service is not None:
            services.send(self.service, sig)  # re-checks identity: a reused pid is never signalled

    async def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM (the service drains and exits 0), then SIGKILL after `timeout`."""
        if not self.running:
            return self.returncode
        self.stopping = True
        self._signal(signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.running and loop.time() < deadline:
            await asyncio.sleep(0.1)
        if self.running:
            self._signal(signal.SIGKILL)
            while self.running:
                await asyncio.sleep(0.1)
        self.returncode = self.proc.wait() if self.proc is not None else None
        return self.returncode
