"""The kernel cache's contents as the console shows them: every entry under the root, judged
against the plan of the next launch and this toolchain (`store.kernel_cache` inventory: current;
another layout, naming the differing component; stale, naming the changed component; corrupt;
partial; quarantined), with sizes, ages, hits, the disk they take and the gc limit. A stale or
other-layout entry's reason is a sentence; its raw key difference (each differing component,
whole, as the keys hold it) rides along for the details view. Plain Python, no torch; made with
each new plan (`plan_watch`), whose inputs include the cache tree."""

from __future__ import annotations

import os
import stat
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CacheSnapshot:
    root: str = ""
    entries: tuple[dict[str, Any], ...] = ()  # Entry.to_json() + purgeable (what `x` may delete here)
    total_bytes: int = 0
    limit_bytes: int = 0  # the gc limit ($DSV4_KERNEL_CACHE_MAX_SIZE)
    disk_free: int | None = None  # on the cache's filesystem
    error: str = ""

    def by_state(self) -> dict[str, int]:
        from store.kernel_cache import STATES

        counts = Counter(e["state"] for e in self.entries)
        return {s.value: counts[s] for s in STATES if counts[s]}


def collect_cache(plan) -> CacheSnapshot:
    """Every entry of the plan's kernel cache, judged against the plan's live keys."""
    from runtime.launch.purge import cache_of, inventory, purgeable
    from store.errors import UserError
    from store.paths import kernel_cache_limit

    root = cache_of(plan).root
    limit = kernel_cache_limit()
    try:
        entries = inventory(plan)
    except (UserError, OSError) as e:
        return CacheSnapshot(str(root), limit_bytes=limit, error=str(e))
    rows = tuple({**e.to_json(), "purgeable": purgeable(e), **_difference(e, plan.keys.get(e.program))}
                 for e in entries)
    return CacheSnapshot(str(root), rows, sum(e.size_bytes for e in entries), limit, free_bytes(root))


MAX_MANIFEST_BYTES = 1 << 20


def _difference(entry, live) -> dict[str, Any]:
    """`{"key difference": {component: "old → new"}}` of a stale or other-layout entry against
    the live key of its program ({} for any other entry, or one whose manifest cannot be read:
    bounded, non-blocking, a regular file only)."""
    from store.fingerprint import diff, raw_difference
    from store.kernel_cache import OTHER_LAYOUT, STALE, Manifest

    if live is None or entry.state not in (STALE, OTHER_LAYOUT):
        return {}
    try:
        fd = os.open(entry.path / "manifest.json", os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            return {}
        key = Manifest.parse(os.read(fd, MAX_MANIFEST_BYTES), entry.program, entry.fingerprint).key
    except Exception:  # a manifest that does not parse says nothing more than the entry's state
        return {}
    finally:
        os.close(fd)
    return {"key difference": raw_difference(diff(key, live))}


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem `path` is (or would be) on: its nearest existing parent's."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None
