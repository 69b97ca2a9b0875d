"""Opening files we only read: regular files only, never blocking, never unbounded.

A FIFO, device, socket or directory where a sidecar, shard, manifest, artifact or history file
is expected must not hang a command (an `open` of a FIFO blocks until a writer appears; a read
of a character device may never end) nor read gigabytes. Every such open goes through here:
the kind is checked before opening, the open is O_NONBLOCK, and the opened fd is checked again
(the path may have been swapped between the two).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"),
    (stat.S_ISREG, "a file"),
)  # fmt: skip


class NotRegularFile(OSError):
    """The path is not a regular file; `strerror` names what it is instead."""


def kind(mode: int) -> str:
    """'a FIFO', 'a directory', 'a file', … for an st_mode."""
    return next((name for test, name in _KINDS if test(mode)), "of unknown kind")


def _check(st: os.stat_result, path: str | Path) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(errno.EINVAL, f"not a regular file ({kind(st.st_mode)})", str(path))


def open_regular(path: str | Path, *, dir_fd: int | None = None, flags: int = 0) -> int:
    """A read-only fd on the regular file at `path`; NotRegularFile (an OSError) otherwise.

    O_NONBLOCK makes the open itself return at once whatever the path turned into; on a
    regular file it changes nothing for later reads, so the fd is used as is.
    """
    _check(os.stat(path, dir_fd=dir_fd), path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | flags, dir_fd=dir_fd)
    try:
        _check(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


class TooLarge(OSError):
    """A file over the size its reader allows."""


def read_fd(fd: int, cap: int | None = None, what: str = "file") -> bytes:
    """All bytes of `fd` from its current offset, refusing more than `cap` before reading. A
    regular file is read in one call of its size + 1 (the byte past it shows a file that grew),
    not in 64 KiB pieces joined after: a hot registration reads 37.5 MiB of kernel-cache
    artifacts this way, where the pieces cost 600 calls and a copy of every byte."""
    size = os.fstat(fd).st_size  # 0 for a pipe or a device: read in pieces
    if cap is not None and size > cap:
        raise TooLarge(errno.EFBIG, f"{what} is {size} bytes, over the {cap}-byte limit")
    chunks = []
    total = 0
    want = max(size + 1, 1 << 16)
    while chunk := os.read(fd, want):
        chunks.append(chunk)
        total += len(chunk)
        if cap is not None and total > cap:  # grew while we read
            raise TooLarge(errno.EFBIG, f"{what} grew past the {cap}-byte limit")
        want = 1 << 16
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def read_regular(path: str | Path, cap: int | None = None, *, dir_fd: int | None = None) -> bytes:
    """The bytes of the regular file at `path` (at most `cap`); OSError for anything else."""
    fd = open_regular(path, dir_fd=dir_fd)
    try:
        return read_fd(fd, cap, os.path.basename(str(path)))
    finally:
        os.close(fd)


def tail_lines(path: str | Path, cap: int) -> list[str]:
    """The lines in the last `cap` bytes of the regular file at `path` (a first line cut by the
    window left out), opened without blocking or following a link; [] for anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return []
        start = max(0, st.st_size - cap)
        lines = os.pread(fd, st.st_size - start, start).decode(errors="replace").splitlines()
    except OSError:
        return []
    finally:
        os.close(fd)
    return lines[1:] if start and lines else lines


def read_record(path: str | Path, cap: int, accept: Callable[[os.stat_result], bool] | None = None) -> Any:
    """The JSON value of a small record file (a regular file, not a link, at most `cap` bytes,
    opened without blocking, and one `accept` takes by its opened fd's stat); None for anything
    else or anything unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap or (accept is not None and not accept(st)):
            return None
        return json.loads(os.read(fd, cap))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
