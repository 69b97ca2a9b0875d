"""The targets of `dsv4 bench sidecar` and whether each is met: checking the data (verify of a
hot sidecar vs `cat`, warm with vs without verify) and the map, probe and prepack-RSS targets.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from bench.sidecar_measure import GIB, RUNS, Row, best

TARGETS = {
    "map_vs_pack": 5.0,  # hot map + touch at least this many times faster than packing
    "map_vs_cat": 1.5,  # and within this factor of `cat FILE > /dev/null` from the page cache
    "probe_ms": 1.0,  # cachestat of a 1 GiB file
    "probe_vs_fincore": 10.0,
    "rss_layers": 3.0,  # prepack peak RSS <= 3 x largest packed layer + 0.5 GiB
    "rss_slack": 0.5 * GIB,
    "verify_vs_cat": 2.0,  # verifying every chunk of a hot sidecar vs `cat` from the page cache
    "warm_verify": 1.3,  # warm with verify vs warm without
}


def verify_rows(path: Path, cat_s: float, measure: Callable[..., float]) -> list[Row]:
    """Checking the data: verify of the hot sidecar vs cat, and warm with vs without verify."""
    from store import pagecache
    from store.sidecar import checksum

    def verify() -> None:
        result = checksum.verify_file(path)
        if not result.ok:
            raise RuntimeError(f"fresh sidecar does not verify: {result.detail}")

    def warm(with_verify: bool) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            check = checksum.verifier(fd) if with_verify else None
        finally:
            os.close(fd)
        pagecache.warm(path, remember=False, sink=check.feed if check else None, chunk=checksum.READ_BYTES)
        if check is not None and not check.result().ok:
            raise RuntimeError("fresh sidecar does not verify while warming")

    verify_s, _ = best(verify, RUNS)
    measure("verify every data chunk (hot, in-process)", verify_s,
            f"best of {RUNS}; xxh3-64 per {checksum.CHUNK_BYTES >> 20} MiB chunk, "
            f"pread {checksum.READ_BYTES >> 20} MiB")
    warm_s, _ = best(lambda: warm(False), RUNS)
    measure("warm (hot, in-process, no verify)", warm_s, f"best of {RUNS}; same read size")
    warmv_s, _ = best(lambda: warm(True), RUNS)
    measure("warm + verify (hot, in-process)", warmv_s, f"best of {RUNS}")
    t = TARGETS
    return [
        Row("target", f"verify of a hot sidecar within {t['verify_vs_cat']:g}x of cat",
            measured=f"{verify_s / cat_s:.2f}x cat", met=verify_s <= t["verify_vs_cat"] * cat_s),
        Row("target", f"warm with verify within {t['warm_verify']:g}x of warm without",
            measured=f"{warmv_s / warm_s:.2f}x", met=warmv_s <= t["warm_verify"] * warm_s),
    ]  # fmt: skip


def target_rows(pack_s, map_s, cat_s, probes, rss, layer_group, layer_bytes) -> list[Row]:
    """Each target and whether it is met; probe targets take the worse of the 1 GiB states."""
    from store.units import format_size

    t = TARGETS
    out = [
        Row(
            "target",
            f"hot map + touch >= {t['map_vs_pack']:g}x faster than packing",
            measured=f"{pack_s / map_s:.1f}x",
            met=pack_s / map_s >= t["map_vs_pack"],
        ),
        Row(
            "target",
            f"hot map + touch within {t['map_vs_cat']:g}x of cat from page cache",
            measured=f"{map_s / cat_s:.2f}x cat",
            met=map_s <= t["map_vs_cat"] * cat_s,
            key="hot_map_touch_vs_cat",
            ratio=map_s / cat_s,
        ),
    ]
    cs = [p["cachestat"] for p in probes if "cachestat" in p]
    name = f"cachestat probe of 1 GiB <= {t['probe_ms']:g} ms"
    if cs:
        shown = " / ".join(f"{c * 1e3:.3f}" for c in cs)
        met = max(cs) * 1e3 <= t["probe_ms"]
        out.append(Row("target", name, measured=f"{shown} ms (written / read back)", met=met))
    else:
        out.append(Row("target", name, measured="cachestat unavailable on this kernel"))
    ratios = [p["fincore"] / p["cachestat"] for p in probes if {"cachestat", "fincore"} <= set(p)]
    name = f"cachestat >= {t['probe_vs_fincore']:g}x faster than fincore"
    if ratios:
        shown = " / ".join(f"{r:.0f}x" for r in ratios)
        met = min(ratios) >= t["probe_vs_fincore"]
        out.append(Row("target", name, measured=f"{shown} (written / read back)", met=met))
    else:
        out.append(Row("target", name, measured="not measurable (cachestat or fincore missing)"))
    bound = t["rss_layers"] * layer_bytes + t["rss_slack"]
    out.append(
        Row(
            "target",
            f"prepack peak RSS <= {t['rss_layers']:g} x largest layer + 0.5 GiB",
            measured=f"{format_size(rss)} vs bound {format_size(bound)} "
            f"(largest layer {layer_group}: {format_size(layer_bytes)})",
            met=rss <= bound,
        )
    )
    return out
