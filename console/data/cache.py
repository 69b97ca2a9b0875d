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
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from store.kernel_cache.entry import Origin


@dataclass(frozen=True, kw_only=True)
class CacheEntry:
    """One entry under the kernel cache root, as the cache view lists it."""

    program: str
    fingerprint: str
    state: str  # store.kernel_cache.EntryState's value: current, other-layout, stale, corrupt, partial, quarantined
    reason: str = ""
    size_bytes: int = 0
    created: float = 0.0
    last_used: float = 0.0
    hits: int = 0
    path: str = ""
    busy: bool = False  # a partial entry whose writer may still be running
    purgeable: bool = False  # what `x` may delete in the cache view (runtime.launch.purge.purgeable)
    origin: Origin | None = None  # where a brought entry came from
    key_difference: Mapping[str, str] = field(default_factory=dict)  # a stale entry's components, "old → new"

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["origin"] = self.origin.to_json() if self.origin else None
        del out["key_difference"]
        out["key difference"] = dict(self.key_difference)  # as the details view says it (and version 5 wrote it)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CacheEntry:
        known = {f.name: raw[f.name] for f in fields(cls) if f.name in raw}
        origin = raw.get("origin")
        try:
            known["origin"] = Origin.parse(origin) if origin else None
        except (KeyError, TypeError, ValueError):  # an older manifest's origin: not enough to say where
            known["origin"] = None
        known["key_difference"] = dict(raw.get("key difference") or {})
        return cls(**known)


@dataclass(frozen=True, kw_only=True)
class CacheSnapshot:
    root: str = ""
    entries: tuple[CacheEntry, ...] = ()
    total_bytes: int = 0
    limit_bytes: int = 0  # the gc limit ($DSV4_KERNEL_CACHE_MAX_SIZE)
    disk_free: int | None = None  # on the cache's filesystem
    error: str = ""

    def by_state(self) -> dict[str, int]:
        from store.kernel_cache import STATES

        counts = Counter(e.state for e in self.entries)
        return {s.value: counts[s] for s in STATES if counts[s]}

    def purgeable(self) -> list[CacheEntry]:
        return [e for e in self.entries if e.purgeable]

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "entries": [e.to_json() for e in self.entries], "total_bytes": self.total_bytes,
                "limit_bytes": self.limit_bytes, "disk_free": self.disk_free, "error": self.error}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> CacheSnapshot:
        return cls(root=str(raw.get("root") or ""),
                   entries=tuple(CacheEntry.from_json(e) for e in raw.get("entries") or ()),
                   total_bytes=int(raw.get("total_bytes") or 0), limit_bytes=int(raw.get("limit_bytes") or 0),
                   disk_free=raw.get("disk_free"), error=str(raw.get("error") or ""))


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
        return CacheSnapshot(root=str(root), limit_bytes=limit, error=str(e))
    rows = tuple(CacheEntry(program=e.program, fingerprint=e.fingerprint, state=str(e.state), reason=e.reason,
                            size_bytes=e.size_bytes, created=e.created, last_used=e.last_used, hits=e.hits,
                            path=str(e.path), busy=e.busy, purgeable=purgeable(e), origin=e.origin,
                            key_difference=_difference(e, plan.keys.get(e.program))) for e in entries)
    return CacheSnapshot(root=str(root), entries=rows, total_bytes=sum(e.size_bytes for e in entries),
                         limit_bytes=limit, disk_free=free_bytes(root))


MAX_MANIFEST_BYTES = 1 << 20


def _difference(entry, live) -> dict[str, str]:
    """`{component: "old → new"}` of a stale or other-layout entry against the live key of its
    program ({} for any other entry, or one whose manifest cannot be read: bounded, non-blocking,
    a regular file only)."""
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
    return dict(raw_difference(diff(key, live)))


def free_bytes(path: Path) -> int | None:
    """Free bytes on the filesystem `path` is (or would be) on: its nearest existing parent's."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize
    return None
