"""The launch history: one JSON line per launch under the user state dir.

Appended with O_APPEND in one write, so concurrent launches never interleave; read without
blocking on a special file, skipping lines that do not parse (a crash mid-line loses one line).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any

MAX_BYTES = 64 << 20  # a history larger than this is read from its tail only


def history_path() -> Path:
    from store.paths import state_dir

    return state_dir() / "launches.jsonl"


def append(record: dict[str, Any]) -> None:
    path = history_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        os.write(fd, (json.dumps(record, default=str) + "\n").encode())
    finally:
        os.close(fd)


def read_history(limit: int | None = None) -> list[dict[str, Any]]:
    try:
        fd = os.open(history_path(), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return []
        start = max(0, st.st_size - MAX_BYTES)
        data = os.pread(fd, st.st_size - start, start)
    finally:
        os.close(fd)
    out = []
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                out.append(record)
    return out[-limit:] if limit else out
