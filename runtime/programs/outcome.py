"""What a launch does with a program, as one enum: the plan predicts it, the programs phase
records it, the launch history keeps it, the console shows it (torch-free)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class Outcome(StrEnum):
    HIT = "HIT"  # a verified entry for the live key: loaded, nothing compiled
    MISS = "MISS"  # no entry for this configuration: compiled
    STALE = "STALE"  # only entries built by another toolchain or from other source: compiled
    CORRUPT = "CORRUPT"  # the entry for the live key failed to read or verify: replaced
    UNTRUSTED = "UNTRUSTED"  # the entry (or the cache root) could be someone else's: not loaded
    EAGER = "EAGER"  # runs uncompiled (the eager backend, or the eager tier of --ready early)

    @classmethod
    def of_miss(cls, kind: str) -> Outcome:
        """The outcome of a kernel-cache miss, by the miss's kind (store.kernel_cache.Miss.kind)."""
        return _MISSES.get(kind, cls.MISS)

    @property
    def compiles(self) -> bool:
        """Whether a launch taking this path compiles the program."""
        return self not in (Outcome.HIT, Outcome.EAGER)


_MISSES = {"stale": Outcome.STALE, "corrupt": Outcome.CORRUPT, "untrusted": Outcome.UNTRUSTED}


def counts(outcomes: Iterable[str]) -> dict[str, int]:
    """Every outcome's count, in enum order (zeros included: the history keeps them all)."""
    seen = list(outcomes)
    return {o.value: seen.count(o) for o in Outcome}
