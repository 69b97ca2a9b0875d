"""Shared pieces of the hostile suite: special files made for real, and a guard against hangs."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

# Each kind of non-regular file a path can turn into; `make` returns False where not permitted.
SPECIAL_KINDS = ("fifo", "directory", "socket", "device")


def make_special(path: Path, kind: str) -> None:
    """Put a real FIFO, directory, socket or character device (a /dev/null twin) at `path`."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        import socket

        s = socket.socket(socket.AF_UNIX)
        cwd = os.getcwd()
        try:
            os.chdir(path.parent)  # a relative name: socket paths are limited to ~108 bytes
            s.bind(path.name)
        finally:
            os.chdir(cwd)
            s.close()
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o644, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod is not permitted here")
    else:
        raise ValueError(kind)


@contextlib.contextmanager
def no_hang(seconds: int = 20) -> Iterator[None]:
    """Fail (rather than hang the suite) if the body blocks, e.g. opening a FIFO for reading."""

    def _alarm(*_: object) -> None:
        raise TimeoutError(f"blocked for {seconds} s: a special file was opened blocking")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def one_line(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    return len(lines) == 1 and "Traceback" not in text
