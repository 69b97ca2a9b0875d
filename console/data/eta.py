"""How long a long action will take: done/total, elapsed, and an ETA from recorded history
(compile seconds per program from the cache manifests; pack and read throughput from earlier
runs), falling back to the rate measured so far.

A measured rate is smoothed (`console.data.rate.Rate`: exponentially weighted by time) and
counts down between progress samples, so an ETA never rises while work completes at the rate
measured; it rises only once the next sample is more than `rate.JITTER` times as late as that
rate says (a stall is slower). Its basis is shown with the rate: `ETA 12s (measured at 48.0
MiB/s)`, or `(history at …)`: the earlier runs' rate, until a span of at least
`rate.MIN_SPAN_S` measured one here."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from console import fmt
from console.data.rate import Rate

MAX_MANIFEST_BYTES = 1 << 20  # a manifest is a few KiB; larger is corrupt (never read whole)
HIT_SECONDS = 0.1  # a verified load of a cached program, when nothing better is recorded


def _compile_seconds(entry_dir: Path) -> float | None:
    try:
        fd = os.open(entry_dir / "manifest.json", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:
            return None
        value = json.loads(os.read(fd, MAX_MANIFEST_BYTES)).get("compile_seconds")
        return float(value) if isinstance(value, int | float) and value >= 0 else None
    except (OSError, ValueError, AttributeError):
        return None
    finally:
        os.close(fd)


def program_seconds(programs: Iterable[Any]) -> dict[str, float]:
    """Expected seconds per program at the next prepare, from the plan's `ProgramPlan`s: a HIT
    loads; a program whose entry the plan names (corrupt, or stale in place) took the compile
    seconds its manifest records; others are unknown (the caller falls back to the measured rate).
    Entries are read on this host only (another host's paths mean nothing here)."""
    out = {}
    for p in programs:
        if not p.state.compiles:
            out[p.program] = HIT_SECONDS
        elif p.entry:
            seconds = _compile_seconds(Path(p.entry))
            if seconds is not None:
                out[p.program] = seconds
    return out


@dataclass
class Progress:
    """One long action as it runs; `line()` renders it through `fmt.progress`."""

    label: str
    unit: str = ""
    done: float | None = None
    total: float | None = None
    now: str = ""
    started: float = field(default_factory=time.monotonic)
    rate: float | None = None  # units per second from earlier runs (pack/read throughput)
    items: dict[str, float] = field(default_factory=dict)  # expected seconds per item (programs)
    finished: set[str] = field(default_factory=set)
    pool: Any = None  # console.data.launch_state.ProgramStates of a compile pool: its own ETA
    measured: Rate = field(default_factory=Rate)  # the rate measured here, sample by sample
    clock: Callable[[], float] = time.monotonic  # what `started`, the samples and `t` are read on

    def update(self, done: float | None = None, total: float | None = None, now: str = "",
               item: str = "", t: float | None = None) -> None:
        self.done = done if done is not None else self.done
        self.total = total if total is not None else self.total
        if item:
            self.finished.add(item)
        self.now = now
        if done is not None:
            self.measured.sample(t if t is not None else self.clock(), done)

    def eta(self, t: float | None = None) -> tuple[float | None, str]:
        """(seconds left, basis) or (None, "") while nothing can say."""
        t = t if t is not None else self.clock()
        if not self.total or self.done is None:
            return None, ""
        left = max(0.0, self.total - self.done)
        if self.pool is not None and (pooled := self.pool.eta()) is not None:  # spread over its workers
            return pooled, "history" if not self.pool.took else "measured"
        if self.items:  # per-item history (programs): what is left, item by item
            known = [s for p, s in self.items.items() if p not in self.finished]
            if known:
                unknown = max(0, int(left) - len(known))
                mean = sum(self.items.values()) / len(self.items)
                return sum(known[: int(left)]) + unknown * mean, "history"
        eta = self.measured.eta(t, self.total, self.rate, self.done)
        if eta is None:
            return None, ""
        measured = self.measured.rate is not None
        rate = self.measured.blended(self.rate) or 0.0
        return eta, f"{'measured' if measured else 'history'} at {fmt.unit_rate(rate, self.unit)}"

    def line(self, t: float | None = None) -> str:
        t = t if t is not None else self.clock()
        eta, basis = self.eta(t)
        return fmt.progress(self.label, self.done, self.total, self.unit, t - self.started, eta, basis, self.now)


def follow(p: Progress, pool: Any, event: Any) -> Any:
    """One event of a running command into its progress line (`p`) and, for a compile pool's
    per-program log events (`dsv4 compile --events`), its programs' states (`pool`, made at the
    first): done, what compiles now, each program's expected seconds. Returns the pool."""
    from console.data.launch_state import ProgramStates

    d = event.detail
    if event.kind == "progress":
        p.update(event.done, event.total, now=str(d.get("group") or d.get("file") or ""),
                 item=str(d.get("program", "")))
    elif event.kind == "start" and isinstance(d.get("total", event.total), int | float):
        p.update(0, d.get("total", event.total))
    elif event.kind == "log" and ProgramStates.applies(d):
        pool = pool or ProgramStates()
        pool.feed(d, event.ts)
        p.pool = pool
        p.items.update(pool.expected)
        p.finished |= pool.finished
        p.update(len(pool.finished), now=pool.now)
    return pool
