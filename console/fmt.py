"""Small text renderings shared by the panes (bars, ages, sizes, rates)."""

from __future__ import annotations

from store.units import format_size


def bar(fraction: float | None, width: int = 12) -> str:
    """`██████░░░░░░  50%`; a dash when unknown."""
    if fraction is None:
        return "-"
    fraction = max(0.0, min(1.0, fraction))
    full = round(fraction * width)
    return "█" * full + "░" * (width - full) + f" {fraction:4.0%}"


def ago(then: float | None, now: float) -> str:
    if not then:
        return "never"
    seconds = max(0.0, now - then)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def size(n: float | None) -> str:
    return "-" if n is None else format_size(n)


def rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def secs(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f} s"
