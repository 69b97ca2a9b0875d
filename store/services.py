"""The runtime registry of `dsv4 serve` processes: one small JSON file per service under
`<state dir>/services/`, written by the service itself, so any console (or script) of this user
sees every service on the host, whoever started it.

A service is one identity (`ServiceId`: host, the launcher's pid and start time) whatever its
rank count: the launcher of `--ranks N` announces it and rank 0 fills in its URL. A record is
trusted only while its process is the one that wrote it: the pid must be alive with the same
start time and command line; a pid reused by another process is never reported as that service
and never signalled.

A service that ends is not forgotten: its record keeps how it ended (`Ending`: exit status or
signal, its phase, its error line, the last lines of its log), written by whoever knew — the
service itself, its launcher, the console whose child it was, or, when nobody could (a SIGKILL
of a process nobody waited for), the registry's own "gone" — until the operator dismisses it.
A "gone" is also the launch's true end in the launch history (`store.history`): the line the
service wrote when it served said "ok", and no launch that ended unseen predicts another.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import socket
import stat
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from store import atomic, history, paths, safeio

VERSION = 2  # 2: host, launch settings, rank logs and the ending; a v1 record still reads
RECORD = re.compile(r"^(\d+)\.json$")
MAX_RECORD_BYTES = 64 << 10  # a record is a few hundred bytes; anything larger is not ours
REGISTERING, SERVING, ENDED = "registering", "serving", "ended"
_START_TOLERANCE = 0.05  # psutil's create_time is rounded to clock ticks (10 ms)
KEEP_ENDED = 20  # ended records kept (newest first) until dismissed; older ones go
ID_ENV = "DSV4_SERVICE_ID"  # the launcher's identity, handed to its ranks (they are that service)
# who recorded an ending, weakest first: a stronger witness replaces a weaker one's words (the
# launcher saw a rank die, which rank 0 only hears of)
WITNESSES = ("registry", "console", "supervisor", "service", "launcher")  # the supervisor saw its exit status
LOG_TAIL_LINES = 5  # an ending keeps this many last lines of the service's log
LOG_TAIL_BYTES = 16 << 10  # read from the log's end, never more
GONE = "gone"


def registry_dir() -> Path:
    return paths.state_dir() / "services"


def output_paths(stamp: str) -> tuple[Path, Path]:
    """(log, events) files for a service the console starts detached: its whole output lives
    under the state dir, so it survives the console and a later console can re-attach."""
    base = registry_dir() / "output"
    return base / f"serve-{stamp}.log", base / f"serve-{stamp}.events.jsonl"


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


@dataclass(frozen=True)
class ServiceId:
    """Which service: the host, and the pid and start time of its launcher (a single process:
    its own). The same in the registry, /health, the launch history and every console line."""

    host: str
    pid: int
    started: float

    @property
    def key(self) -> str:
        return f"{self.host}/{self.pid}/{self.started:.2f}"

    def to_env(self) -> dict[str, str]:
        return {ID_ENV: json.dumps(asdict(self))}

    @classmethod
    def of_process(cls, pid: int) -> ServiceId:
        return cls(socket.gethostname(), pid, round(_create_time(pid) or 0.0, 2))

    @classmethod
    def of_this_process(cls) -> ServiceId:
        """The service this process is (one of the ranks of): its launcher's identity when one
        handed it down, else this process's own."""
        with contextlib.suppress(KeyError, ValueError, TypeError):
            raw = json.loads(os.environ[ID_ENV])
            return cls(str(raw["host"]), int(raw["pid"]), float(raw["started"]))
        return cls.of_process(os.getpid())


def how(code: int) -> str:
    """An exit status in words, as a shell would say it (negative: the signal that killed it)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return "stopped" if code == 0 else f"exited {code}"


@dataclass(frozen=True)
class Ending:
    """How a service ended: `how` ("killed by SIGKILL", "exited 1", "stopped by SIGTERM", "gone"),
    the phase it was in, its error line, who recorded it, and the last lines of its log then."""

    at: float
    how: str
    phase: str = ""
    error: str = ""
    by: str = "service"
    log: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "log": list(self.log)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Ending:
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        return cls(**{**known, "log": tuple(str(x) for x in raw.get("log") or ())})

    def line(self, now: float | None = None) -> str:
        """`killed by SIGKILL 12 s ago during serve: <error>`: its age as of `now` (render it
        again as time goes: the age moves)."""
        ago = max(0.0, (now or time.time()) - self.at)
        when = (f"{ago:.0f} s ago" if ago < 120 else f"{ago / 60:.0f} min ago" if ago < 7200
                else f"{ago / 3600:.0f} h ago")
        return self.cause(f"{self.how} {when}")

    def cause(self, how: str | None = None) -> str:
        """`killed by SIGKILL during serve: <error>`: how, the phase, and the error line — the cause,
        never the log's last line (those are `log`)."""
        text = (how or self.how) + (f" during {self.phase}" if self.phase else "")
        return text + (f": {self.error}" if self.error else "")


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
    host: str = field(default_factory=socket.gethostname)
    backend: str = ""
    device: str = ""
    max_seq: int | None = None
    ranks: int = 1
    rank_logs: tuple[str, ...] = ()  # rank r's output (the launcher of several ranks keeps them apart)
    log_file: str = ""  # the service's own log (of several ranks, rank 0's): capped, rotated (store.logs)
    previous_log: str = ""  # the previous run's log of the same slot, kept beside it
    rank_log_files: tuple[str, ...] = ()  # each rank's own log, on its host (a service of several ranks)
    ending: Ending | None = None
    v: int = VERSION

    @property
    def identity(self) -> ServiceId:
        return ServiceId(self.host, self.pid, round(self.create_time, 2))

    @property
    def ended(self) -> bool:
        return self.ending is not None

    @property
    def from_console(self) -> bool:
        """Started detached by a console (its output lives in the registry's output dir)."""
        return bool(self.events) and Path(self.events).parent == registry_dir() / "output"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "cmdline": list(self.cmdline), "rank_logs": list(self.rank_logs),
                "rank_log_files": list(self.rank_log_files), "ending": self.ending.to_json() if self.ending else None}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Service:
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        ending = raw.get("ending")
        return cls(**{**known, "cmdline": tuple(raw["cmdline"]), "rank_logs": tuple(raw.get("rank_logs") or ()),
                      "rank_log_files": tuple(raw.get("rank_log_files") or ()),
                      "ending": Ending.from_json(ending) if isinstance(ending, dict) else None, "v": VERSION})


def _identity(pid: int) -> tuple[float, tuple[str, ...]] | None:
    try:
        p = psutil.Process(pid)
        return p.create_time(), tuple(p.cmdline())
    except (psutil.Error, OSError):
        return None


def is_current(service: Service) -> bool:
    """The pid still runs the process that registered (same start time and command line)."""
    if service.host != socket.gethostname():
        return False  # another host's pid says nothing here
    found = _identity(service.pid)
    return (found is not None and abs(found[0] - service.create_time) <= _START_TOLERANCE
            and found[1] == service.cmdline)


def _stdout_file() -> str:
    """Where this process's stdout goes when it is a regular file (a detached service's log)."""
    with contextlib.suppress(OSError):
        if stat.S_ISREG(os.fstat(1).st_mode):
            return os.readlink("/proc/self/fd/1")
    return ""


def _path(pid: int) -> Path:
    return registry_dir() / f"{pid}.json"


def _write(service: Service) -> None:
    path = _path(service.pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes_atomic(path, json.dumps(service.to_json()).encode())


class Announcement:
    """A running service's own record: written at start, updated when it serves, and at its end
    turned into how it ended. Rank 0 under the project's launcher adopts the launcher's record
    (the service is the launcher's identity) instead of writing one of its own."""

    def __init__(self, model: str, events: str = "", **settings: Any):
        me = psutil.Process()
        self.service = Service(os.getpid(), me.create_time(), tuple(me.cmdline()), model,
                               log=_stdout_file(), events=events, **settings)
        self._write()

    @classmethod
    def adopt(cls, identity: ServiceId) -> Announcement | None:
        """The launcher's record of `identity`, to update as rank 0 (None: there is none)."""
        found = _read(_path(identity.pid))
        if found is None or found.identity != identity:
            return None
        self = cls.__new__(cls)
        self.service = found
        return self

    def _write(self) -> None:
        _write(self.service)

    def update(self, **changes: Any) -> None:
        self.service = replace(self.service, **changes)
        self._write()

    def serving(self, url: str) -> None:
        self.update(state=SERVING, url=url)

    def end(self, how_: str, phase: str = "", error: str = "", by: str = "service") -> None:
        """Record how this service ended (see `end`), after what it wrote so far reached its log."""
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
            sys.stderr.flush()
        end(self.service, how_, phase, error, by)

    def withdraw(self) -> None:
        """Gone without a word to say (a stop the operator asked for): the record goes."""
        with contextlib.suppress(OSError):
            _path(self.service.pid).unlink()


def end(service: Service, how_: str, phase: str = "", error: str = "", by: str = "service") -> Service:
    """Record how `service` ended, unless a better witness already did (its launcher's words on a
    dead rank beat the service's own, which beat a console's, which beat the registry's "gone"),
    with the last lines of its log. The read, the comparison and the write hold the registry's
    lock: a registry sweep that read the record before a console wrote its words must not write
    "gone" over them."""
    return _end(service, how_, phase, error, by)[0]


def gone(service: Service, phase: str, error: str, by: str = "registry") -> Service:
    """Record that `service` ended with nobody to say how (its pid is gone, or is another
    process now): its ending "gone", and — once, by whoever wrote that ending — the launch's true
    end in the launch history (outcome `unknown`: it never predicts another launch)."""
    ended, wrote = _end(service, GONE, phase, error, by)
    if wrote:
        with contextlib.suppress(OSError):
            history.append({"v": 1, "launch": ended.identity.key, "outcome": "unknown", "end": GONE,
                            "error": error, "failed_phase": phase, "ended": ended.ending.at,
                            "model": ended.model, "host": ended.host, "pid": ended.pid,
                            "started": round(ended.started, 3)})
    return ended


def _end(service: Service, how_: str, phase: str, error: str, by: str) -> tuple[Service, bool]:
    """(the record after `end`, whether this call wrote the ending)."""
    tail = log_tail(service.log)  # before the lock: a read of the log's end, bounded
    with _locked():
        current = _read(_path(service.pid))
        if current is not None and current.identity != service.identity:
            return service, False  # the pid's record is another service's now
        base = current or service
        if base.ending is not None and WITNESSES.index(base.ending.by) >= WITNESSES.index(by):
            return base, False
        ending = Ending(round(time.time(), 3), how_, phase, error[:500], by, tail or (base.ending.log if base.ending
                                                                                     else ()))
        ended = replace(base, state=ENDED, ending=ending)
        try:
            _write(ended)
        except OSError:
            return ended, False
        return ended, True


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> tuple[str, ...]:
    """The last `lines` non-empty lines of a log: a regular file only, opened without blocking,
    at most LOG_TAIL_BYTES read from its end (() when there is none to read)."""
    if not path:
        return ()
    return tuple(line[:500] for line in safeio.tail_lines(path, LOG_TAIL_BYTES) if line.strip())[-lines:]


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """An exclusive flock on the registry directory itself (no lock file to leave behind); held
    for one read-compare-write of a few hundred bytes. Without a directory, nothing to guard."""
    root = registry_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _read(path: Path) -> Service | None:
    raw = safeio.read_record(path, MAX_RECORD_BYTES)
    if not isinstance(raw, dict) or raw.get("v") not in (1, VERSION):
        return None
    try:
        return Service.from_json(raw)
    except (ValueError, TypeError, KeyError):
        return None


def services() -> list[Service]:
    """Every service of this host the registry knows: the running ones (whose process is still
    the one that registered), oldest first, then the ended ones, newest first. A record whose
    process is gone without an ending becomes an ended one ("gone"); only files the registry's
    naming produced are touched, and ended records past the newest KEEP_ENDED are removed."""
    root = registry_dir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    live, ended = [], []
    for name in names:
        m = RECORD.match(name)
        if not m:
            continue
        service = _read(root / name)
        if service is None or service.pid != int(m.group(1)):
            with contextlib.suppress(OSError):
                (root / name).unlink()
        elif service.ended:
            ended.append(service)
        elif is_current(service):
            live.append(service)
        elif service.host == socket.gethostname():
            ended.append(gone(service, service.state, "no exit status was recorded (killed, or the host restarted)"))
    ended.sort(key=lambda s: s.ending.at if s.ending else 0, reverse=True)
    for old in ended[KEEP_ENDED:]:
        dismiss(old)
    return sorted(live, key=lambda s: s.create_time) + ended[:KEEP_ENDED]


def running() -> list[Service]:
    """The services whose process still runs, oldest first."""
    return [s for s in services() if not s.ended]


def find(pid: int) -> Service | None:
    """The record of `pid`, ended or not (None: none)."""
    return _read(_path(pid))


def dismiss(service: Service) -> bool:
    """Forget an ended service (the operator saw it): its record goes; a live one stays."""
    current = _read(_path(service.pid))
    if current is None or current.identity != service.identity or not current.ended:
        return False
    with contextlib.suppress(OSError):
        _path(service.pid).unlink()
    return True


def send(service: Service, sig: int = signal.SIGTERM) -> bool:
    """Signal the service if its pid is still that service; False (nothing sent) otherwise."""
    if not is_current(service):
        return False
    try:
        os.kill(service.pid, sig)
    except ProcessLookupError:
        return False
    return True


def stop(service: Service, timeout: float, poll: float = 0.1) -> str:
    """SIGTERM a service this process does not hold (it drains), SIGKILL after `timeout`; each
    signal only after re-checking that the pid is still that service. How it ended, in words:
    stopped as asked (its record goes: nothing left to dismiss), or killed (recorded)."""
    if not send(service, signal.SIGTERM):
        return "not running (nothing sent)"
    deadline = time.monotonic() + timeout
    while is_current(service) and time.monotonic() < deadline:
        time.sleep(poll)
    if send(service, signal.SIGKILL):
        end(service, "killed by SIGKILL", "", f"did not stop within {timeout:g} s of SIGTERM", by="console")
        return "killed by SIGKILL"
    dismiss(find(service.pid) or service)  # stopped as asked: no row left behind
    return "stopped by SIGTERM"
