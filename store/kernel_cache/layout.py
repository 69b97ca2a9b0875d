"""Where a kernel cache keeps things: the root, the two settings writers honour, and the paths
derived from them (see the package docstring for the tree).

`Layout` is the value the helper modules take instead of the cache object, so that they depend
only on data and never on each other through `KernelCache`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from store.kernel_cache.entry import LOCKS, QUARANTINE, TRASH, VERSION_DIR

# A compile may take minutes; past this we compile anyway (the lock is an optimisation).
LOCK_TIMEOUT = 1800.0


@dataclass(frozen=True)
class Layout:
    """One cache root and how to write in it."""

    root: Path
    # False skips fsync: only for synthetic caches (benchmarks), never for real ones.
    durable: bool = True
    lock_timeout: float = LOCK_TIMEOUT

    @property
    def base(self) -> Path:
        """The tree of this format version: `<root>/v1`."""
        return self.root / VERSION_DIR

    @property
    def quarantine(self) -> Path:
        return self.root / QUARANTINE

    @property
    def trash(self) -> Path:
        return self.root / TRASH

    def entry(self, program: str, fp: str) -> Path:
        return self.base / program / fp

    def lock(self, program: str, fp: str) -> Path:
        return self.base / LOCKS / f"{program}.{fp}.lock"

    def trusted_dirs(self, program: str | None = None) -> list[Path]:
        """The dirs a lookup (of `program`) relies on: none may be writable by others."""
        return [self.root, self.base] + ([self.base / program] if program else [])


def rand() -> str:
    """The 8 hex digits that keep staging, trash and quarantine names unique (the patterns in
    store.kernel_cache.entry and store.atomic expect exactly these)."""
    return os.urandom(4).hex()
