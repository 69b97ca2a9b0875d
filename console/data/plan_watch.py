"""The plan of the next launch (runtime.launch.plan, torch-free) as the console keeps it, and the
kernel cache's contents judged against it: recomputed only when one of their inputs changed or
when the plan is older than MAX_AGE (page-cache residency moves on its own), so an idle refresh
costs a few stat calls, not a plan.

What a refresh stats: the checkpoint dir's files, the launch history, and the kernel cache's
tree down to its entries (program/fingerprint dirs and their mtimes: an entry published,
quarantined, removed or with a file added or deleted). A file changed in place inside an entry
is the file watcher's to report (the console invalidates the plan on every change it sees), and
MAX_AGE's otherwise: statting every file of a large cache on every refresh cost more than the
rest of an idle console together (1,000 entries: 28 ms every 2 s)."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

MAX_AGE = 30.0  # seconds: residency (hot/cold) changes without any file changing
MAX_STATS = 20_000  # a cache tree larger than this is stamped by its upper directories only
CACHE_DEPTH = 3  # listed: the root, v1, each program dir (its fingerprint dirs, not their files)


def _entries(path: Path) -> list[tuple[str, int, int, bool]]:
    """(name, size, mtime, is a real dir) of what `path` holds, sorted."""
    out = []
    with contextlib.suppress(OSError), os.scandir(path) as it:
        for e in it:
            with contextlib.suppress(OSError):
                st = e.stat(follow_symlinks=False)
                out.append((e.name, st.st_size, st.st_mtime_ns, e.is_dir(follow_symlinks=False)))
    return sorted(out)


def _tree(root: Path, depth: int, budget: list[int]) -> tuple:
    """What `root` holds, and the dirs below it `depth` levels down."""
    rows = _entries(root)
    budget[0] -= len(rows)
    if depth <= 1 or budget[0] <= 0:
        return tuple(rows)
    return tuple((name, _tree(root / name, depth - 1, budget)) for name, _, _, is_dir in rows if is_dir) + tuple(rows)


def stamp(model_dir: Path, cache_dir: Path, history: Path) -> tuple:
    """What the plan depends on, cheaply: changes whenever the structure of a plan input changes."""
    hist = None
    with contextlib.suppress(OSError):
        st = history.stat()
        hist = (st.st_size, st.st_mtime_ns)
    return (tuple(_entries(model_dir)), _tree(cache_dir, CACHE_DEPTH, [MAX_STATS]), hist)


class PlanWatch:
    """`get()` → (the Plan, its report), recomputed only when needed; `cache`: the kernel
    cache's contents as of that plan. `local_ranks`: the service's ranks on this host (a service
    across hosts sizes each host's KV for its own ranks)."""

    def __init__(self, spec: Any, clock=time.monotonic, local_ranks: int | None = None):
        from console.data.cache import CacheSnapshot

        self.spec, self.local_ranks = spec, local_ranks
        self.model_dir, self.cache_dir = spec.model, spec.kernel_cache_dir
        self.clock = clock
        self.plan: Any = None
        self.report: Any = None  # runtime.launch.plan_report.PlanReport
        self.cache = CacheSnapshot(root=str(self.cache_dir))
        self._stamp: tuple | None = None
        self._made = 0.0
        self.computed = 0  # how many plans were made (the bench and tests read it)

    def get(self, history: list[dict[str, Any]] | None = None) -> tuple[Any, Any]:
        from store.history import history_path

        now_stamp = stamp(self.model_dir, self.cache_dir, history_path())
        if self.report is None or now_stamp != self._stamp or self.clock() - self._made > MAX_AGE:
            self._make(history)
            self._stamp = now_stamp
        return self.plan, self.report

    def invalidate(self) -> None:
        """Recompute at the next `get()` (residency moved across what the verdict depends on, or
        the file watch saw a change). The plan made last stays what `get` answers until then: a
        collection on another thread never finds none."""
        self._stamp = None

    def _make(self, history: list[dict[str, Any]] | None) -> None:
        from console.data.cache import collect_cache
        from runtime.launch.plan import make_plan
        from runtime.launch.plan_report import PLAN_FAILED, PlanReport, Problem

        self._made = self.clock()
        self.computed += 1
        try:
            # never reads a shard's bytes: a refresh uses the digests a launch or `dsv4 plan` computed
            self.plan = make_plan(self.spec, history=history, digests="remembered", local_ranks=self.local_ranks)
            self.report = self.plan.report()
            self.cache = collect_cache(self.plan)
        except Exception as e:  # make_plan says what is wrong in its parts; this is our own bug
            self.plan = None
            self.report = PlanReport(model=str(self.model_dir), spec=self.spec, problems=(
                Problem(kind=PLAN_FAILED, text=f"{type(e).__name__}: {e}"),))
