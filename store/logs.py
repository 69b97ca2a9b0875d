"""Log files the project writes and keeps: capped, rotated, the previous run's kept beside.

Two kinds of file use this: a service's log (`runtime.log`: one line per request, a summary
every 10 s, each phase, each warning) and each host's timeline of events (`store.timeline`). Both
append whole lines with `append_capped`: one `write` of an O_APPEND descriptor (lines of
concurrent writers never interleave, a crash loses at most the line being written, which readers
skip), opened without blocking and without following a link (a FIFO or a symlink planted at the
path is refused, never written through). Past `cap` bytes the file is rotated: `name` → `name.1`
→ … → `name.KEEP`, the oldest dropped, by whichever writer takes the file's lock without waiting
(a writer that does not get it appends and leaves the rotation to the other: never blocking).

A service's log lives in a **slot** (`claim`): `serve-8000.log` for the service on port 8000. A
run claims its slot by holding a lock beside it for its whole life; the previous run's files move
to `serve-8000.prev.log` (k9s keeps a restarted container's previous log the same way), so the
operator reads what the last run said after a relaunch. A slot another live process holds is left
alone: the run writes `serve-8000-<pid>.log` instead.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from store import paths, safeio

LOG_CAP = 16 << 20  # a service's log file: past this it rotates (KEEP files kept: 48 MiB at most a run)
KEEP = 2
_held: list[int] = []  # the slot locks this process holds, open for its whole life


def services_log_dir() -> Path:
    """Where `dsv4 serve` keeps its logs by default: `<state dir>/services/logs`."""
    return paths.state_dir() / "services" / "logs"


def rotated(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def previous_of(path: Path) -> Path:
    """`serve-8000.log` → `serve-8000.prev.log`: where the slot's previous run's log is kept."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def _open_append(path: Path) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise safeio.NotRegularFile(errno.EINVAL, f"not a regular file ({safeio.kind(st.st_mode)})", str(path))
    return fd


def _rotate(path: Path, fd: int, keep: int) -> bool:
    """Shift `path` to `path.1` (and on) under its lock, taken without waiting; False when
    another writer holds it or rotated it already (this one then appends where it is)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    try:
        if os.stat(path, follow_symlinks=False).st_ino != os.fstat(fd).st_ino:
            return False  # rotated by another writer between our open and our lock
        for n in range(keep, 1, -1):
            with contextlib.suppress(FileNotFoundError):
                os.replace(rotated(path, n - 1), rotated(path, n))
        os.replace(path, rotated(path, 1))
        return True
    except OSError:
        return False
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def append_capped(path: Path, data: bytes, cap: int, keep: int = KEEP) -> None:
    """Append `data` (whole lines) to `path` in one write, rotating first when it would pass
    `cap` bytes. OSError (a FIFO or link at the path, a full disk) is the caller's to swallow."""
    fd = _open_append(path)
    try:
        size = os.fstat(fd).st_size
        if size and size + len(data) > cap and _rotate(path, fd, keep):
            os.close(fd)
            fd = _open_append(path)
        os.write(fd, data)
    finally:
        os.close(fd)


def read_tail(path: Path, cap: int, keep: int = KEEP) -> list[str]:
    """The last lines of a capped file and its rotations, oldest first, at most `cap` bytes
    of each (a regular file only, opened without blocking or following a link)."""
    out: list[str] = []
    for p in [rotated(path, n) for n in range(keep, 0, -1)] + [path]:
        out += safeio.tail_lines(p, cap)
    return out


@dataclass(frozen=True)
class Slot:
    """A log file claimed by this process for its run, and where the run before it is kept."""

    path: Path
    previous: Path | None  # the previous run's log ("": none was there)


def _lock(path: Path) -> int | None:
    """The slot's lock, held from now on (None: another live process holds it)."""
    fd = os.open(path.with_name(f"{path.name}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    _held.append(fd)  # never closed: the lock lasts as long as the process
    return fd


def claim(path: Path, keep: int = KEEP) -> Slot:
    """Claim the log slot `path` for this run: its previous run's files (if any) move to
    `previous_of(path)`, this run writes `path`. A slot held by a live process is left alone
    and this run writes `<stem>-<pid><suffix>` (no previous run there). OSError when the
    directory cannot be made or locked (the caller says so in one line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if _lock(path) is None:
        path = path.with_name(f"{path.stem}-{os.getpid()}{path.suffix}")
        _lock(path)
    if not os.path.lexists(path):
        return Slot(path, None)
    prev = previous_of(path)
    for n in range(keep, 0, -1):  # the previous run's rotations go with it; an older run's go
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rotated(prev, n))
        with contextlib.suppress(FileNotFoundError):
            os.replace(rotated(path, n), rotated(prev, n))
    if not stat.S_ISREG(os.lstat(path).st_mode):  # not ours to move: someone planted it
        raise safeio.NotRegularFile(errno.EINVAL, "not a regular file", str(path))
    os.replace(path, prev)
    return Slot(path, prev)
