"""Small text renderings shared by the panes (bars, ages, sizes, rates)."""

from __future__ import annotations

from runtime.contract import Quantile
from store.units import format_age, format_duration, format_size


def bar(fraction: float | None, width: int = 12) -> str:
    """`██████░░░░░░  50%`; a dash when unknown."""
    if fraction is None:
        return "-"
    fraction = max(0.0, min(1.0, fraction))
    full = round(fraction * width)
    return "█" * full + "░" * (width - full) + f" {fraction:4.0%}"


def ago(then: float | None, now: float) -> str:
    return f"{format_age(now - then)} ago" if then else "never"


def size(n: float | None) -> str:
    return "-" if n is None else format_size(n)


def rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def secs(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f} s"


def duration(s: float | None) -> str:
    """`42s`, `3m05s`, `1h02m`: elapsed times, uptimes and ETAs."""
    return format_duration(s)


def progress(label: str, done: float | None, total: float | None, unit: str, elapsed: float,
             eta: float | None, basis: str = "", now: str = "") -> str:
    """The one progress line of every long action (launch phases, compile, prepack, warm):
    `compile 3/14 · 42s elapsed · ETA 1m10s (history) · now: head.decode`."""
    parts = [label] if label else []
    if done is not None and total:
        parts.append(f"{size(done)} / {size(total)}" if unit == "bytes" else f"{done:.0f}/{total:.0f}")
    parts.append(f"{duration(elapsed)} elapsed")
    if eta is not None:
        parts.append(f"ETA {duration(eta)}" + (f" ({basis})" if basis else ""))
    line = " · ".join(parts)
    return f"{line} · now: {now}" if now else line


def latency(q: Quantile) -> str:
    """A latency with its unit: `640 ms`, `1.2 s`; past its histogram's top bucket the bound it
    lies beyond, `>5.1 s` (never the bound as a value); "-" for none."""
    if q.above is not None:
        return f">{q.above:.2g} s"
    if q.value is None:
        return "-"
    if q.value < 1:
        return f"{q.value * 1000:.2g} ms" if q.value < 0.01 else f"{q.value * 1000:.0f} ms"
    return f"{q.value:.2g} s" if q.value < 10 else f"{q.value:.0f} s"


def per_second(value: float | None) -> str:
    """A rate: one decimal below 100, "-" for none."""
    return "-" if value is None else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def unit_rate(rate: float, unit: str) -> str:
    """A long action's rate with its unit: `48.0 MiB/s` (unit "bytes"), `1.50 programs/s`."""
    if unit == "bytes":
        return f"{size(rate)}/s"
    return f"{rate:.2f} {unit}/s" if unit else f"{rate:.2f}/s"


SPARKS = "▁▂▃▄▅▆▇█"


def bars(values, width: int, top: float | None = None) -> str:
    """`values` as `width` bars (each the peak of its share of them), from 0 to `top` (a percent:
    100) or to their peak: a flat line at the top is drawn full, a flat 0 a floor of `▁`."""
    values = [max(0.0, float(v)) for v in values]
    if not values or width <= 0:
        return ""
    scale = max(top or 0.0, max(values))
    n = len(values)
    out = []
    for i in range(width):
        lo = i * n // width
        v = max(values[lo:max(lo + 1, (i + 1) * n // width)])
        out.append(SPARKS[min(len(SPARKS) - 1, int(v / scale * (len(SPARKS) - 1) + 0.5))] if scale > 0 else SPARKS[0])
    return "".join(out)


def spark(values, width: int = 8, top: float | None = None) -> str:
    """The last `width` values as a one-line sparkline and its scale: the bars (`bars`) and their
    peak beside them (`▃▅▇█ 182`); "-" for none."""
    values = [max(0.0, float(v)) for v in values][-width:]
    if not values:
        return "-"
    return f"{bars(values, len(values), top)} {max(values):.3g}"
