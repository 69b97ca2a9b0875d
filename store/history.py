"""The launch history: one JSON line per launch under the user state dir.

Appended with O_APPEND in one write, so concurrent launches never interleave; read without
blocking on a special file, skipping lines that do not parse (a crash mid-line loses one line).

A launch is one record however many lines speak of it: lines with the same `launch` (the
service's identity, `store.services.ServiceId.key`) merge in order, a later line's outcome and
end replacing an earlier one's (the service recorded "ok" when it served; its launcher, or the
console whose child it was, records later that it was killed).
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
    out: list[dict[str, Any]] = []
    by_launch: dict[str, dict[str, Any]] = {}
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if not isinstance(record, dict):
                continue
            key = record.get("launch")
            if isinstance(key, str) and key in by_launch:
                merge(by_launch[key], record)
                continue
            if isinstance(key, str):
                by_launch[key] = record
            out.append(record)
    return out[-limit:] if limit else out


def merge(base: dict[str, Any], later: dict[str, Any]) -> None:
    """A later line about the same launch into its record: its words win, except that phases
    the record has keep their seconds (a launcher's line knows none) and the start stays."""
    phases = {**(later.get("phases") or {}), **(base.get("phases") or {})}
    predicted = base.get("predicted") or later.get("predicted") or {}
    started = base.get("started", later.get("started"))
    base.update({k: v for k, v in later.items() if v not in (None, "", {})})
    base.update(phases=phases, predicted=predicted, started=started)
