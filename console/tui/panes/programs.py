"""Programs pane, two views one key (`c`) apart: the next launch's programs (the plan: HIT
loads, MISS/STALE/CORRUPT compiles, and why), and the kernel cache's contents (every entry
under the root, judged against that plan and this toolchain, with size, age and hits, the disk
it takes against the gc limit). Enter shows a row's full key, entry and manifest."""

from __future__ import annotations

import time
from typing import Any

from rich.markup import escape
from textual.app import ComposeResult
from textual.widgets import Static

from console import fmt
from console.data.cache import CacheEntry, CacheSnapshot
from console.data.snapshot import ProgramsSnapshot
from console.tui.panes.base import JobLine, Pane
from console.tui.tables import Column, PaneTable, row_of, title
from runtime.launch.plan_report import ProgramPlan
from store.kernel_cache.entry import Origin

STATE_STYLE = {"HIT": "green", "MISS": "cyan", "STALE": "yellow", "CORRUPT": "red", "UNTRUSTED": "red",
               "EAGER": "dim", "current": "green", "other-layout": "cyan", "stale": "yellow", "corrupt": "red",
               "partial": "dim", "quarantined": "red"}
# problems first: what a launch replaces, then what it compiles, then what it loads
OUTCOME_RANK = {"CORRUPT": 0, "UNTRUSTED": 1, "STALE": 2, "MISS": 3, "EAGER": 4, "HIT": 5}
COMPILE_STYLE = {"queued": "dim", "compiling": "yellow", "failed": "red"}  # `w`'s compile, program by program
ENTRY_RANK = {"corrupt": 0, "quarantined": 1, "stale": 2, "partial": 3, "other-layout": 4, "current": 5}
COLUMNS = (
    Column("program", "program", 26, essential=True),
    Column("state", "next launch", 11, essential=True, rank=OUTCOME_RANK),
    Column("fingerprint", "fp", 12),
    Column("reason", "why", 40),
)
CACHE_COLUMNS = (  # what decides a purge first: the state and why, then use, then identity
    Column("program", "program", 24, essential=True),
    Column("state", "state", 12, essential=True, rank=ENTRY_RANK),
    Column("size_bytes", "size", 9, essential=True),
    Column("reason", "why", 34),
    Column("hits", "hits", 5),
    Column("last_used", "last hit", 9),
    Column("created", "age", 6),
    Column("fingerprint", "fp", 12),
)


def origin(o: Origin | None) -> str:
    """Where a brought entry came from — host, signer, reference, when (nothing for one built here)."""
    return o.short(time.time()) if o is not None else ""


def styled(state: str) -> str:
    style = STATE_STYLE.get(state, "")
    return f"[{style}]{state}[/]" if style else state


class ProgramsPane(Pane):
    """The plan's programs, or (`c`) the kernel cache's contents."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.now = 0.0
        self.viewing_cache = False
        self.compiling: dict[str, str] = {}  # program → what a running `w` compile does to it now
        self._shown: tuple[ProgramsSnapshot, CacheSnapshot, str] | None = None

    def compose(self) -> ComposeResult:
        yield PaneTable("programs", COLUMNS, self._cells, id="programs-table", sort_key="state")
        cache = PaneTable("cache", CACHE_COLUMNS, self._cache_cells, id="cache-table", sort_key="state")
        cache.display = False
        yield cache
        yield Static(id="programs-totals", classes="totals")
        yield JobLine(id="programs-job")

    def on_mount(self) -> None:
        self.border_title = "Programs"

    def _cells(self, row: dict[str, Any]) -> dict[str, str]:
        e: ProgramPlan = row["value"]
        state = styled(e.state)
        now = self.compiling.get(e.program)
        if now and e.state != "HIT":  # a compile in flight says where this program is until the plan sees it
            state = f"[{COMPILE_STYLE.get(now, 'green')}]{now}[/]"
        return {"program": e.program, "state": state, "fingerprint": (e.fingerprint or "")[:12], "reason": e.reason}

    def _cache_cells(self, row: dict[str, Any]) -> dict[str, str]:
        e: CacheEntry = row["value"]
        return {"program": e.program, "state": styled(e.state), "size_bytes": fmt.size(e.size_bytes),
                "fingerprint": e.fingerprint[:12], "created": fmt.ago(e.created, self.now).removesuffix(" ago"),
                "hits": str(e.hits), "last_used": fmt.ago(e.last_used, self.now) if e.hits else "never",
                "reason": "; ".join(filter(None, [e.reason, origin(e.origin)]))}

    def job(self, label: str, done: float | None = None, total: float | None = None,
            states: dict[str, str] | None = None) -> None:
        """Show a running compile (label empty: hide) and each program's state in it."""
        self.query_one(JobLine).show(label, done, total)
        states = dict(states or {}) if label else {}
        if states != self.compiling:
            self.compiling = states
            if self._shown is not None:
                self.show(*self._shown[:2], self.now, self._shown[2])

    def toggle(self) -> PaneTable:
        """Switch views; returns the table now shown (the caller focuses it)."""
        self.viewing_cache = not self.viewing_cache
        self.query_one("#programs-table", PaneTable).display = not self.viewing_cache
        self.query_one("#cache-table", PaneTable).display = self.viewing_cache
        if self._shown is not None:
            self.show(*self._shown[:2], self.now, self._shown[2])
        return self.query_one("#cache-table" if self.viewing_cache else "#programs-table", PaneTable)

    def show(self, snap: ProgramsSnapshot, cache: CacheSnapshot, now: float, needle: str = "") -> None:
        self.now, self._shown = now, (snap, cache, needle)
        programs = self.query_one("#programs-table", PaneTable).set_rows([row_of(e) for e in snap.entries], needle)
        entries = self.query_one("#cache-table", PaneTable).set_rows([row_of(e) for e in cache.entries], needle)
        if self.viewing_cache:
            self.border_title = title("Kernel cache", *entries, needle, "entries") + " [dim](c: programs)[/]"
            text = self._cache_totals(cache)
        else:
            self.border_title = title("Programs", *programs, needle) + " [dim](c: kernel cache)[/]"
            states = ", ".join(f"{n} {s}" for s, n in snap.by_state().items())
            text = (states or "no programs") + f"  [dim]{snap.root}[/]"
            if snap.problem:
                text += f"\n[red]{escape(snap.problem.line())}[/]"
            elif snap.warning:
                text += f"\n[yellow]{snap.warning}[/]"
        self.query_one("#programs-totals", Static).update(text)

    @staticmethod
    def _cache_totals(cache: CacheSnapshot) -> str:
        """`45 entries · 123 MiB of 10.0 GiB gc limit · disk free 50 GiB · x deletes 5 (12 MiB)`."""
        if cache.error:
            return f"[red]{cache.error}[/]"
        share = f" ({cache.total_bytes / cache.limit_bytes:.0%})" if cache.limit_bytes else ""
        parts = [f"{len(cache.entries)} entries", f"{fmt.size(cache.total_bytes)} of {fmt.size(cache.limit_bytes)} "
                 f"gc limit{share}"]
        if cache.disk_free is not None:
            parts.append(f"disk free {fmt.size(cache.disk_free)}")
        unusable = cache.purgeable()
        if unusable:
            parts.append(f"x deletes {len(unusable)} ({fmt.size(sum(e.size_bytes for e in unusable))})")
        states = ", ".join(f"{s} {n}" for s, n in cache.by_state().items())
        return " · ".join(parts) + (f"\n{states}  [dim]{cache.root}[/]" if states else f"  [dim]{cache.root}[/]")
