"""Quarantine: entries that failed to read, verify or load, kept for inspection.

`<root>/quarantine/<program>--<fp16>--<time>--<rand>/` with a small `quarantine.json` record.
A record that is missing, unreadable, malformed or oversized is one line in the listing and
never empties it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from store import safeio
from store.kernel_cache.entry import (
    MAX_QUARANTINE_NOTE_BYTES,
    QUARANTINE_NOTE,
    QUARANTINED,
    Entry,
)  # fmt: skip
from store.kernel_cache.layout import Layout, rand
from store.kernel_cache.trust import ensure_dir, marker_problem, ours, real_dirs, tree_size


def quarantine(layout: Layout, entry: Path, reason: str, expect: tuple[int, int] | None = None) -> Path | None:
    """Move an entry out of the lookup path, keeping it for inspection; None if it vanished,
    is not ours to move, or, with `expect` (dev, ino), if the dir there now is not the one
    that was judged."""
    if marker_problem(layout.root) or not ours(layout, entry):
        return None
    if expect is not None:
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            return None
        if (st.st_dev, st.st_ino) != expect:
            return None
    qdir = layout.quarantine
    ensure_dir(qdir)
    dest = qdir / f"{entry.parent.name}--{entry.name[:16]}--{int(time.time())}--{rand()}"
    try:
        os.rename(entry, dest)
    except FileNotFoundError:
        return None
    note = {"program": entry.parent.name, "fingerprint": entry.name, "reason": reason, "when": time.time()}
    with contextlib.suppress(OSError):
        (dest / QUARANTINE_NOTE).write_text(json.dumps(note)[:MAX_QUARANTINE_NOTE_BYTES])
    return dest


def _note(path: Path) -> tuple[dict, str]:
    """A quarantine record and, when it is unreadable or malformed, one line saying so."""
    try:
        note = json.loads(safeio.read_regular(path / QUARANTINE_NOTE, MAX_QUARANTINE_NOTE_BYTES))
    except FileNotFoundError:
        return {}, ""
    except OSError as e:
        return {}, f"record unreadable ({e.strerror})"
    except (ValueError, RecursionError):
        return {}, "record is not valid JSON"
    if not isinstance(note, dict):
        return {}, "record is not a JSON object"
    return note, ""


def quarantined(layout: Layout) -> list[Entry]:
    """The inventory lines of the quarantined entries (state QUARANTINED, the record's reason)."""
    out = []
    for d in sorted(real_dirs(layout.quarantine), key=lambda d: d.name):
        path = Path(d.path)
        note, problem = _note(path)
        try:
            when = float(note.get("when", 0.0))
        except (TypeError, ValueError):
            when, problem = 0.0, problem or "record time is not a number"
        reason = problem or str(note.get("reason", "unknown reason"))
        out.append(
            Entry(
                str(note.get("program", d.name.split("--")[0])), str(note.get("fingerprint", "")),
                QUARANTINED, f"quarantined: {reason}"[:500], tree_size(path), when, when, 0, path,
            )
        )
    return out
