"""`dsv4 bench roofline --products`: the native products alone against this host's bandwidth, the
micro-benchmark each change to `runtime.model.native`'s kernels is decided by.

The library is built from this checkout's source (`runtime.model.native.build`, into a temporary
directory: what the kernel cache would build), and each product runs at 1, 2, 4 and 8 rows on the
shapes a decode step of `small` reads most: an FP8 `[1024, 1024]` weight (block scales 128 ×
128), a routed expert's FP4 `[1024, 512]` weight (scale groups of 32, one expert through the
grouped call), and the BF16 output head `[1024, 32768]`. Every weight is one of a pool of copies
larger than the last-level cache, each call the next copy, so every byte comes from memory, as in
a decode step (a weight warm in L3 reads several times faster). A figure is the weight's bytes
(scales included) ÷ seconds, with the read bandwidth (`bench.bandwidth`, measured in the same
turns) beside it: the share of the bound that product reaches. On torch's threads (the service's)
and on one; in REPEATS turns taking each shape, row count and thread count in order, so a drift
of a shared host falls on all; the median pass and the best.

Beside each figure from memory, the same product on one copy read again and again, from the caches
(a weight that fits the last-level cache with room to spare: not the head): the rate its own
arithmetic allows, whatever the memory. Where that rate is below the read bandwidth the product is
bound by its arithmetic on this host (`limit`: "compute"), and no memory faster than this one
would make it faster: the ceiling a decode step's share of the bandwidth bound meets first.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROWS = (1, 2, 4, 8)
REPEATS = 5
POOL_BYTES = 96 << 20  # past a 32 MiB L3 several times over
SHAPES = {"fp8 [1024, 1024]": (1024, 1024), "fp4 [1024, 512]": (1024, 512), "bf16 [1024, 32768]": (1024, 32768)}
HOT_BYTES = 4 << 20  # a weight read again from the caches: well inside a last-level cache of 16 MiB or more


def _one(name: str, gen) -> tuple:
    """One weight of the shape `name` and its scales (None for BF16)."""
    import torch

    i, o = SHAPES[name]
    if name.startswith("fp8"):
        return (torch.randint(0, 126, (i, o), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn),
                torch.randint(118, 128, (i // 128, o // 128), dtype=torch.uint8, generator=gen))
    if name.startswith("fp4"):  # one expert's stacks, as the grouped call takes them
        return (torch.randint(0, 256, (1, i // 2, o), dtype=torch.uint8, generator=gen),
                torch.randint(118, 128, (1, i // 32, o), dtype=torch.uint8, generator=gen))
    return torch.randn(i, o, generator=gen).bfloat16(), None


def _pool(name: str, gen) -> list[tuple]:
    """Copies of one weight (and its scales) up to POOL_BYTES."""
    first = _one(name, gen)
    return [first, *(_one(name, gen) for _ in range(max(2, POOL_BYTES // _bytes(*first)) - 1))]


def _bytes(weight, scale) -> int:
    return weight.numel() * weight.element_size() + (0 if scale is None else scale.numel())


def _runner(native: Any, name: str, x) -> Callable[[tuple], Any]:
    """A call of the product as the service makes it: FP8 and BF16 through the `dsv4::dense` op (the
    programs' call: its C++ kernel on the library), FP4 through the library's grouped entry made once
    a weight (`Native.grouped_call`; `Native.ffn` keeps its arguments a layer likewise): not through
    `Native.grouped`, whose checks in Python, some 20 us a call, were counted as the product's."""
    import torch

    if not name.startswith("fp4"):
        return lambda ws: torch.ops.dsv4.dense(x, *ws)
    out = torch.empty(x.shape[0], SHAPES[name][1], dtype=torch.float32)
    made: dict[tuple[int, int], Callable[[], None]] = {}  # by the weight's and its scales' addresses

    def call(ws: tuple) -> Any:
        packed, scale = ws
        if (product := made.get(key := (packed.data_ptr(), scale.data_ptr()))) is None:
            product = made[key] = native.grouped_call(x, [0], [0, x.shape[0]], packed, scale, out)
        product()
        return out

    return call


def _pass(run: Callable[[tuple], Any], pool: list[tuple]) -> float:
    """GB/s over one pass through the pool (each call a copy not read since the last pass)."""
    t0 = time.perf_counter()
    for ws in pool:
        run(ws)
    return sum(_bytes(*ws) for ws in pool) / (time.perf_counter() - t0) / 1e9


def _hot(run: Callable[[tuple], Any], pool: list[tuple]) -> float | None:
    """GB/s of as many calls as a pass on the pool's first copy, warm in the caches: the product's
    own arithmetic (None for a weight too large to stay there)."""
    if _bytes(*pool[0]) > HOT_BYTES:
        return None
    run(pool[0])
    t0 = time.perf_counter()
    for _ in pool:
        run(pool[0])
    return _bytes(*pool[0]) * len(pool) / (time.perf_counter() - t0) / 1e9


def measure(repeats: int = REPEATS, rows: tuple[int, ...] = ROWS, log: Callable[[str], None] = print) -> dict[str, Any]:
    import torch

    from bench.bandwidth import Meter, best
    from runtime.model import native as native_module
    from runtime.model.ops import native_restored, use_native

    with tempfile.TemporaryDirectory(prefix="dsv4-products-") as tmp:
        lib = Path(tmp) / "native.so"
        log("building the native products from this checkout's source …")
        native_module.build(lib)
        native = native_module.load(lib.read_bytes())
    gen = torch.Generator().manual_seed(0)
    pools = {name: _pool(name, gen) for name in SHAPES}
    xs = {n: torch.randn(n, 1024, generator=gen) for n in rows}
    service_threads = torch.get_num_threads()
    threads = sorted({service_threads, 1}, reverse=True)
    meter = Meter()
    samples: dict[tuple[str, int, int], list[float]] = {}
    hot: dict[tuple[str, int, int], list[float]] = {}
    bandwidth = []
    with native_restored():  # what served this process before serves it again after
        use_native(native)  # `dsv4::dense` on this library's kernel
        try:
            for name, pool in pools.items():  # warm: the first calls fault pages and load code
                _pass(_runner(native, name, xs[rows[0]]), pool)
            for turn in range(repeats):
                log(f"turn {turn + 1}/{repeats} …")
                bandwidth.append(meter.measure(runs=2))
                for t in threads:
                    torch.set_num_threads(t)
                    for name, pool in pools.items():
                        for n in rows:
                            run = _runner(native, name, xs[n])
                            samples.setdefault((name, n, t), []).append(_pass(run, pool))
                            if (gbs := _hot(run, pool)) is not None:
                                hot.setdefault((name, n, t), []).append(gbs)
        finally:
            torch.set_num_threads(service_threads)
            meter.close()
    bw = best(bandwidth)
    products = []
    for (name, n, t), gbs in samples.items():
        median = statistics.median(gbs)
        cached = statistics.median(hot[name, n, t]) if (name, n, t) in hot else None
        products.append({"product": name, "rows": n, "threads": t, "gbs_median": round(median, 2),
                         "gbs_best": round(max(gbs), 2), "gbs_worst": round(min(gbs), 2),
                         "share": round(median / bw.read_gbs, 4),
                         "gbs_in_cache": None if cached is None else round(cached, 2),
                         "limit": None if cached is None else "compute" if cached < bw.read_gbs else "memory"})
    return {"bandwidth_gbs": round(bw.read_gbs, 2), "threads": service_threads, "isa": native.isa_name,
            "products": products}


def table(r: dict[str, Any]) -> tuple[str, list[str], list[list]]:
    rows = [[p["product"], p["rows"], p["threads"], p["gbs_median"], f"{p['gbs_worst']}-{p['gbs_best']}",
             f"{p['share']:.1%}", "-" if p["gbs_in_cache"] is None else p["gbs_in_cache"], p["limit"] or "-"]
            for p in r["products"]]
    return (f"the native products ({r['isa']}), weights read from memory, against the read bandwidth "
            f"{r['bandwidth_gbs']} GB/s ({r['threads']} threads); in cache: one copy read again and again",
            ["product", "rows", "threads", "GB/s (median)", "GB/s worst-best", "share of the bandwidth",
             "GB/s in cache", "limit"], rows)
