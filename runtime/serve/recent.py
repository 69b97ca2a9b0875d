"""The service's own recent figures: rates and latency quantiles over its last 10 s and minute.

A reader that scrapes /metrics twice and divides sees nothing move between two scrapes a second
apart while a slow service generates, and reads 0; a quantile drawn from a histogram's buckets is
at best a bucket's bound. So the service keeps its own window, as vLLM's logger does: one slot a
second (counts, and a histogram of each latency in fine log-spaced buckets, each 2^(1/8) ≈ 9% wider
than the one before), the last minute of them. `figures(window)` sums the window's slots (and
`seconds(first, end)` whole seconds, for a reader that must count each second once): rates
over the window (or the service's age, when younger: a fresh service is not averaged with seconds
it did not live) and each quantile as the upper bound of its fine bucket — at most 9% over the
true value, never under it. Past the largest bucket (an hour) a quantile is `above` it.

Thread-safe: tokens are counted on the engine thread, requests on the event loop, figures read by
/health and the summary line.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable

from runtime.contract import LATENCIES, QUANTILES, WINDOWS, Latency, Quantile, Recent

SMALLEST = 1e-4  # seconds: the first bucket holds everything up to this
RATIO = 2 ** (1 / 8)  # each bucket's bound over the one before
LARGEST = 3600.0  # past this a quantile is `above` it
_TOP = math.ceil(math.log(LARGEST / SMALLEST, RATIO))
KEEP_S = int(max(WINDOWS.values())) + 1
COUNTS = ("requests", "prompt_tokens", "generation_tokens")


def bucket(seconds: float) -> int:
    """The fine bucket of a latency: 0 up to SMALLEST, _TOP + 1 past LARGEST."""
    if seconds <= SMALLEST:
        return 0
    return min(_TOP + 1, math.ceil(math.log(seconds / SMALLEST, RATIO) - 1e-9))


def bound(index: int) -> float:
    return SMALLEST * RATIO ** index


class _Slot:
    __slots__ = ("counts", "latencies")

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.latencies: dict[str, Counter[int]] = {name: Counter() for name in LATENCIES}


class Tally:
    """Counts and latencies, one slot per second of the last minute."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = clock()
        self._slots: dict[int, _Slot] = {}
        self._lock = threading.Lock()

    def _slot(self) -> _Slot:
        now = int(self.clock())
        slot = self._slots.get(now)
        if slot is None:
            slot = self._slots[now] = _Slot()
            for old in [s for s in self._slots if s <= now - KEEP_S]:
                del self._slots[old]
        return slot

    def add(self, what: str, n: float = 1) -> None:
        """Count `n` of `what`: requests, prompt_tokens, generation_tokens, finish:<reason>,
        status:<code>."""
        with self._lock:
            self._slot().counts[what] += n

    def observe(self, latency: str, seconds: float) -> None:
        """One latency of LATENCIES (ttft, itl, e2e, queue), in seconds."""
        with self._lock:
            self._slot().latencies[latency][bucket(max(0.0, seconds))] += 1

    def figures(self, window: float) -> Recent:
        """What happened over the last `window` seconds (the current second included)."""
        now = self.clock()
        age = now - self.started
        span = max(1.0, min(window, age))
        # younger than the window: everything since its first second (its age spans one more slot than
        # ceil(age) when it started late in a second, and a one-shot read must not miss that first one)
        first = int(self.started) if age <= window else int(now) - math.ceil(span) + 1
        return self._sum(first, None, span)

    def seconds(self, first: int, end: int) -> Recent:
        """What happened in the whole seconds first..end (end not included), its rates over the part
        of them the tally lived: read once each, by a reader taking turns (the summary line), every
        second counts in one reading, none lost between two and none twice."""
        return self._sum(first, end, max(1e-3, end - max(float(first), self.started)))

    def _sum(self, first: int, end: int | None, span: float) -> Recent:
        counts: Counter[str] = Counter()
        hists: dict[str, Counter[int]] = {name: Counter() for name in LATENCIES}
        with self._lock:
            for second, slot in self._slots.items():
                if second >= first and (end is None or second < end):
                    counts.update(slot.counts)
                    for name, hist in slot.latencies.items():
                        hists[name].update(hist)
        rate = {k: round(counts[k] / span, 3) for k in COUNTS}

        def kind(prefix: str) -> dict[str, int]:
            return {k.removeprefix(prefix): int(n) for k, n in sorted(counts.items()) if k.startswith(prefix)}

        return Recent(round(span, 3), rate["requests"], rate["prompt_tokens"], rate["generation_tokens"],
                      kind("finish:"), kind("status:"), **{name: latency(h) for name, h in hists.items()})

    def windows(self) -> dict[str, Recent]:
        return {name: self.figures(seconds) for name, seconds in WINDOWS.items()}


def latency(hist: Counter[int]) -> Latency:
    """Quantiles of a fine histogram: each its bucket's upper bound (never under the value)."""
    total = sum(hist.values())
    if not total:
        return Latency()
    order = sorted(hist.items())

    def at(q: float) -> Quantile:
        seen, rank = 0, q * total
        for index, n in order:
            seen += n
            if seen >= rank:
                return Quantile(above=LARGEST) if index > _TOP else Quantile(float(f"{bound(index):.4g}"))
        return Quantile(above=LARGEST)

    return Latency.of(total, **{name: at(q) for name, q in QUANTILES})
