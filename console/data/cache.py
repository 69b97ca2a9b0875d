"""The kernel cache's contents as the console shows them: every entry under the root, judged
against the plan of the next launch and this toolchain (`store.kernel_cache` inventory: current;
another layout, naming the differing component; stale, naming the changed component; corrupt;
partial; quarantined), with sizes, ages, hits, the disk they take and the gc limit. Plain Python,
no torch; made with each new plan (`plan_watch`), whose inputs include the cache tree."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
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
    rows = tuple({**e.to_json(), "purgeable": purgeable(e)} for e in entries)
    return CacheSnapshot(str(root), rows, sum(e.size_bytes for e in entries), limit, _free(root))


def _free(root) -> int | None:
    for path in (root, root.parent):
        try:
            st = os.statvfs(path)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None
