"""The runtime registry of running `dsv4 serve` processes: one small JSON file per service
under `<state dir>/services/`, written by the service itself, so any console (or script) of
this user sees every service on the host, whoever started it.

A record is trusted only while its process is the one that wrote it: the pid must be alive
with the same start time and command line. A pid reused by another process fails that check,
is never reported and never signalled, and its stale record is removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from store import atomic, paths

VERSION = 1
RECORD = re.compile(r"^(\d+)\.json$")
MAX_RECORD_BYTES = 64 << 10  # a record is a few hundred bytes; anything larger is not ours
REGISTERING, SERVING = "registering", "serving"
_START_TOLERANCE = 0.05  # psutil's create_time is rounded to clock ticks (10 ms)


def registry_dir() -> Path:
    return paths.state_dir() / "services"


def output_paths(stamp: str) -> tuple[Path, Path]:
    """(log, events) files for a service the console starts detached: its whole output lives
    under the state dir, so it survives the console and a later console can re-attach."""
    base = registry_dir() / "output"
    return base / f"serve-{stamp}.log", base / f"serve-{stamp}.events.jsonl"


@dataclass(frozen=True)
class Service:
    pid: int
    create_time: float
    cmdline: tuple[str, ...]
    model: str
    state: str = REGISTERING
    url: str = ""
    log: str = ""
    events: str = ""
    started: float = field(default_factory=time.time)
    v: int = VERSION

    @property
    def from_console(self) -> bool:
        """Started detached by a console (its output lives in the registry's output dir)."""
        return bool(self.events) and Path(self.events).parent == registry_dir() / "output"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "cmdline": list(self.cmdline)}


def _identity(pid: int) -> tuple[float, tuple[str, ...]] | None:
    try:
        p = psutil.Process(pid)
        return p.create_time(), tuple(p.cmdline())
    except (psutil.Error, OSError):
        return None


def is_current(service: Service) -> bool:
    """The pid still runs the process that registered (same start time and command line)."""
    found = _identity(service.pid)
    return (found is not None and abs(found[0] - service.create_time) <= _START_TOLERANCE
            and found[1] == service.cmdline)


def _stdout_file() -> str:
    """Where this process's stdout goes when it is a regular file (a detached service's log)."""
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.fstat(1).st_mode):
            return os.readlink("/proc/self/fd/1")
    return ""


class Announcement:
    """A running service's own record: written at start, updated when it serves, removed on exit."""

    def __init__(self, model: str, events: str = ""):
        me = psutil.Process()
        self.service = Service(os.getpid(), me.create_time(), tuple(me.cmdline()), model,
                               log=_stdout_file(), events=events)
        self.path = registry_dir() / f"{self.service.pid}.json"
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_bytes_atomic(self.path, json.dumps(self.service.to_json()).encode())

    def serving(self, url: str) -> None:
        self.service = Service(**{**self.service.to_json(), "cmdline": self.service.cmdline,
                                  "state": SERVING, "url": url})
        self._write()

    def withdraw(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()


def _read(path: Path) -> Service | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD_BYTES:
            return None
        raw = json.loads(os.read(fd, MAX_RECORD_BYTES))
        if not isinstance(raw, dict) or raw.get("v") != VERSION:
            return None
        return Service(**{**raw, "cmdline": tuple(raw["cmdline"])})
    except (OSError, ValueError, TypeError, KeyError):
        return None
    finally:
        os.close(fd)


def running() -> list[Service]:
    """Every registered service whose process is still the one that registered, oldest first.
    Records of dead or reused pids are removed (only files the registry's naming produced)."""
    root = registry_dir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for name in names:
        m = RECORD.match(name)
        if not m:
            continue
        service = _read(root / name)
        if service is not None and service.pid == int(m.group(1)) and is_current(service):
            out.append(service)
        else:
            with contextlib.suppress(OSError):
                (root / name).unlink()
    return sorted(out, key=lambda s: s.create_time)


def send(service: Service, sig: int = signal.SIGTERM) -> bool:
    """Signal the service if its pid is still that service; False (nothing sent) otherwise."""
    if not is_current(service):
        return False
    try:
        os.kill(service.pid, sig)
    except ProcessLookupError:
        return False
    return True
