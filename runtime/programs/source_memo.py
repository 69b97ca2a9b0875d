"""Named program functions' source components, remembered across processes with what they were
computed from.

`runtime.programs.source_hash` computes a function's components by parsing and walking the
project's files (most of a launch plan's time) and records what that read: a `Trace` of each
file's sha256 and each module lookup's answer. This keeps the components and their trace in one
small file in the state dir, by the function's "module:qualname" and under this Python's version
(the AST it hashes is the version's); a later process reuses them only where the whole trace still
holds, so a changed byte in any file they came from, or a module that appeared or went, computes
them again. The file is a cache: missing, unreadable, malformed or of another version, it is
ignored and rewritten; a state dir that cannot be written costs the computation next time, never
the plan. What it says chooses which compiled programs a launch loads, so it is trusted as a
kernel cache's root is: read only when it is a regular file of this user's (opened without
following a link) that nobody else may write, and written private (0600).
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

from runtime.programs.source_hash import Trace, traced_components
from store import safeio
from store.atomic import write_bytes_atomic
from store.fingerprint import UNKNOWN
from store.kernel_cache.trust import ownership_problem
from store.paths import state_dir

MEMO_FILE = "source-components.json"
VERSION = 1
MAX_BYTES = 8 << 20  # a few hundred functions' traces; anything larger is not ours
MAX_ROOTS = 256  # the oldest go first beyond this

_lock = threading.Lock()


def source_components(root: str) -> list[tuple[str, str]]:
    """`source_hash.source_components(root)`: remembered, or computed (and remembered where every
    unit was read)."""
    remembered = recall(root)
    if remembered is not None:
        return remembered
    components, trace = traced_components(root)
    if all(h != UNKNOWN for _, h in components):
        remember(root, trace, components)
    return components


def recall(root: str) -> list[tuple[str, str]] | None:
    """The remembered components of `root`, if its trace still holds; else None."""
    entry = _roots().get(root)
    if not isinstance(entry, dict):
        return None
    trace, components = _trace_of(entry), _components_of(entry)
    if trace is None or components is None or not trace.holds():
        return None
    return components


def remember(root: str, trace: Trace, components: list[tuple[str, str]]) -> None:
    """Keep `root`'s components with the trace they were computed from (best effort)."""
    with _lock:
        roots = {k: v for k, v in _roots().items() if k != root}
        roots[root] = {"files": trace.files, "lookups": trace.lookups, "components": [list(c) for c in components]}
        while len(roots) > MAX_ROOTS:
            roots.pop(next(iter(roots)))
        data = json.dumps({"v": VERSION, "python": sys.version, "roots": roots}).encode()  # in their order
        path = state_dir() / MEMO_FILE
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(path, data, mode=0o600)
        except OSError:
            pass


def _roots() -> dict[str, Any]:
    """The file's entries (insertion order: oldest first), or {} for anything but this version's."""
    raw = safeio.read_record(state_dir() / MEMO_FILE, MAX_BYTES, lambda st: ownership_problem(st) is None)
    roots = raw.get("roots") if isinstance(raw, dict) and raw.get("v") == VERSION \
        and raw.get("python") == sys.version else None
    return roots if isinstance(roots, dict) else {}


def _strings(value: Any) -> dict[str, str] | None:
    ok = isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    return value if ok else None


def _trace_of(entry: dict[str, Any]) -> Trace | None:
    files, lookups = _strings(entry.get("files")), _strings(entry.get("lookups"))
    return Trace(dict(files), dict(lookups)) if files and lookups is not None else None  # a root reads its file


def _components_of(entry: dict[str, Any]) -> list[tuple[str, str]] | None:
    value = entry.get("components")
    if not isinstance(value, list) or not value:
        return None
    pairs = [tuple(c) for c in value if isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c)]
    return pairs if len(pairs) == len(value) else None
