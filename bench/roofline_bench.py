"""`dsv4 bench roofline`: every step against what this host's cores allow, in one run.

- the limit: this host's memory bandwidth (a read-only pass and a STREAM triad, `bench.bandwidth`,
  on torch's threads: one rank's) and the float32 GEMM rate at each shape a prefill multiplies
  (`runtime.model.ops.matmul`: the project's own route to MKL or oneDNN);
- a decode step of 1, 8 and 32 rows (one new token of each of that many sequences after a
  PROMPT-token prompt): the bytes it must read (`bench.step_cost`: each weight once, the routed
  experts its rows picked, the head, the KV rows they attend), its measured seconds (the median
  of every sample), and the share of the bandwidth bound it reaches: (bytes ÷ bandwidth) ÷ seconds;
- a prefill of 256 and 1024 tokens (one prompt): its FLOPs, its seconds, and the share of the GEMM
  bound: the seconds its weights' products take at the measured rate of each shape ÷ its seconds;
- each split by program family (layer programs: attention, shared expert, routing; the routed
  experts; the head; the embedding), each family's time measured by wrapping its programs, so the
  least efficient part of a step is named. What no family holds is the engine around the programs;
- within a decode step, its native products (`products_timed`: the `dsv4::dense` calls of the layers
  and the head, the routed experts' calls), their seconds and bytes, the programs' other work beside
  them, and the products' ceiling: the share of the step's bound a step of nothing but these products
  would reach, the most these kernels allow whatever the rest of the step (an eager launch has none).

The engine is a launch of the preset's checkpoint in this process (`--backend`; programs from the
user's kernel cache, compiled on the first run), without MTP. Every figure is measured in turns
(bandwidth, each decode size, each prefill, REPEATS times) so a drift of a shared host falls on all
of them; bandwidth is the best pass (a ceiling), step times the median. Reported, never asserted:
the targets (issue 72) are decode ≥ DECODE_TARGET of the bound at 1 row, the 8-row step ≤
STEP_8_TARGET × the 1-row step, a 1024-token prefill ≥ PREFILL_TARGET of the GEMM bound.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

from bench.step_cost import (
    EXPERTS,
    FAMILIES,
    HEAD,
    KV,
    LAYER,
    decode_bytes,
    gemm_seconds,
    prefill_flops,
)

DECODE_ROWS, PREFILL_TOKENS = (1, 8, 32), (256, 1024)
PROMPT = 32  # each decoding sequence's prompt (its rows then sit at position PROMPT)
STEPS = 8  # decode steps per size and turn
REPEATS = 3  # turns
DECODE_TARGET, STEP_8_TARGET, PREFILL_TARGET = 0.70, 1.5, 0.50
MAX_SEQ = 1024  # `dsv4 serve`'s default: the programs are the ones a default launch compiles
GROUPED = "experts grouped (eager)"  # bench.peer_bench's name of the eagerly grouped experts


def _family(name: str) -> str:
    """A program family of `bench.peer_bench.time_programs`' names (its eager grouped experts: experts)."""
    return EXPERTS if name == GROUPED else name


def record_routing(engine: Any) -> list[Any]:
    """Wrap the engine's layer programs (in place) so each call appends its rows' expert choices
    ([rows, top-k] global ids) to the returned list: the routing a step's bytes and GEMMs follow.
    Only where the layer programs hand their routed experts on (`ROUTED_APART`, one rank)."""
    from runtime.model.forward import FFN_PARTS, ROUTED_INPUT

    table = getattr(engine.runners, "table", None)
    if table is None or engine.p.expert_parallel:
        raise RuntimeError("the roofline needs one rank's programs with the routed experts apart")
    seen: list[Any] = []

    def recorded(run: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            out = run(*args)
            if isinstance(out, list | tuple) and len(out) >= FFN_PARTS:
                seen.append(out[ROUTED_INPUT.start + 1])
            return out
        return call

    for name in [n for n in table if n.startswith("layer.")]:
        table[name] = recorded(table[name])
    return seen


@dataclass
class Products:
    """What the native products took of some steps (`products_timed`): the `dsv4::dense` calls
    (the layers' and the head's FP8 and BF16 weights: seconds, calls, and the bytes of the weights
    and scales they read) and the routed experts' native calls (`Native.ffn`: seconds and calls;
    their bytes are the experts the rows picked, `bench.step_cost`)."""

    dense_s: float = 0.0
    dense_bytes: int = 0
    dense_calls: int = 0
    experts_s: float = 0.0
    experts_calls: int = 0


def _dense_bytes(shapes: list) -> int:
    """The bytes of a `dsv4::dense` call's weight from its inputs' shapes (x, w, scale): FP8 (a byte
    a weight) and its block scales, or BF16 (two bytes, no scale): the op multiplies no other."""
    _, (i, o), scale = shapes[:3]
    return i * o + math.prod(scale) if scale else 2 * i * o


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """The process's stderr (fd 2) to /dev/null for a profiler's start or stop: torch's profiler
    (kineto) writes a line at each, whatever its log level: eighteen lines a roofline run."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def products_timed(native: Any) -> Iterator[Products]:
    """Time the native products of the steps run in the block, filled in when it ends: the
    `dsv4::dense` calls from torch's profiler (the programs call the op from C++, where no wrapper
    reaches; the profiler adds a microsecond or two a call, part of it within a call's time: the
    output's allocation is recorded too), `native`'s `ffn` (the experts' calls, from Python)
    wrapped on the instance for the block."""
    from torch.profiler import ProfilerActivity, profile

    got, p = Products(), profile(activities=[ProfilerActivity.CPU], record_shapes=True)
    ffn = getattr(native, "ffn", None)
    if ffn is not None:
        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return ffn(*args)
            finally:
                got.experts_s += time.perf_counter() - t0
                got.experts_calls += 1
        native.ffn = timed
    try:
        with _kineto_quiet():
            p.start()
        try:
            yield got
        finally:
            with _kineto_quiet():
                p.stop()
    finally:
        if ffn is not None:
            del native.ffn  # the class's method again
    for e in p.events():
        if e.name == "dsv4::dense":
            got.dense_s += e.cpu_time_total / 1e6
            got.dense_bytes += _dense_bytes(e.input_shapes)
            got.dense_calls += 1


class Steps:
    """The launch's engine, its slots filled with prompts, stepped and timed by family."""

    def __init__(self, engine: Any, rows: int, vocab: int):
        import torch

        from bench.peer_bench import prompts, time_programs

        self.engine, self.torch = engine, torch
        self.routing = record_routing(engine)
        self.spent = time_programs(engine)
        self.prefill_slot = rows  # a slot of its own: the decoding ones keep their prompts
        for slot, prompt in enumerate(prompts(rows, PROMPT, vocab)):
            engine.reset(slot)
            engine.step([(slot, torch.tensor(prompt))], logits_rows=[1])
        self.token = torch.tensor([7])
        self.vocab = vocab

    def _timed(self, run: Callable[[], Any]) -> dict[str, Any]:
        self.spent.clear()
        self.routing.clear()
        t0 = time.perf_counter()
        run()
        seconds = time.perf_counter() - t0
        families = {_family(k): v for k, v in self.spent.items()}
        return {"seconds": seconds, "families": families, "routing": [r.clone() for r in self.routing]}

    def decode(self, rows: int) -> dict[str, Any]:
        """One decode step of `rows` sequences, each then cut back to its prompt (every sample
        decodes at the same positions)."""
        engine = self.engine

        def step() -> None:
            engine.step([(s, self.token) for s in range(rows)], logits_rows=[1] * rows)

        sample = self._timed(step)
        for s in range(rows):
            engine.truncate(s, PROMPT)
        return sample

    def products(self, rows: int, steps: int) -> Products:
        """`steps` decode steps of `rows` rows with their native products timed (`products_timed`:
        the profiler makes these steps slower than the timed ones, not their products)."""
        from runtime.model.ops import native_products

        with products_timed(native_products()) as got:
            for _ in range(steps):
                self.decode(rows)
        return got

    def prefill(self, tokens: int) -> dict[str, Any]:
        torch, slot = self.torch, self.prefill_slot
        prompt = torch.tensor([(13 * k + 5) % self.vocab for k in range(tokens)])
        self.engine.reset(slot)
        return self._timed(lambda: self.engine.step([(slot, prompt)], prefill=True, logits_rows=[1]))


def gemm_rates(shapes: set[tuple[int, int, int]], rounds: int = 3, runs: int = 2) -> dict[tuple[int, int, int], float]:
    """The float32 GEMM rate (FLOP/s) of x [rows, in] @ w [in, out] at each shape, through
    `runtime.model.ops.matmul`: the best of `runs` a round over `rounds` rounds of every shape, so
    a burst of another process's work (which stalls every 2-thread OpenMP region) spoils a round,
    not a shape's figure."""
    import torch

    from runtime.model.ops import matmul

    operands = {shape: (torch.randn(shape[0], shape[1]), torch.randn(shape[1], shape[2])) for shape in sorted(shapes)}
    best = dict.fromkeys(operands, float("inf"))
    for _ in range(rounds):
        for shape, (x, w) in operands.items():
            matmul(x, w)  # warm: oneDNN picks and caches its kernel for the shape
            for _ in range(runs):
                t0 = time.perf_counter()
                matmul(x, w)
                best[shape] = min(best[shape], time.perf_counter() - t0)
    return {(rows, i, o): 2.0 * rows * i * o / best[(rows, i, o)] for rows, i, o in operands}


def _median_sample(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(samples, key=lambda s: s["seconds"])[(len(samples) - 1) // 2]


def _share(ideal: float, seconds: float) -> float | None:
    return round(ideal / seconds, 4) if seconds > 0 else None


def measure(preset: str = "small", backend: str = "aoti", rows: tuple[int, ...] = DECODE_ROWS,
            prefills: tuple[int, ...] = PREFILL_TOKENS, repeats: int = REPEATS, steps: int = STEPS,
            log: Callable[[str], None] = print) -> dict[str, Any]:
    import torch

    from bench.bandwidth import Meter, best
    from runtime.events import Emitter
    from runtime.launch.registration import register
    from runtime.launch.spec import LaunchSpec
    from runtime.synth.checkpoint import ensure_default_model
    from store.paths import kernel_cache_dir

    model = ensure_default_model(preset)[0]
    log(f"launching {preset} ({backend}; programs in {kernel_cache_dir()}) …")
    spec = LaunchSpec(model, backend=backend, device="cpu", max_seq=MAX_SEQ, max_slots=max(rows) + 1,
                      speculative="off")
    launched = register(spec, Emitter(lambda _e: None), record=False)
    meter = Meter()
    try:
        programs, weights = launched.programs, launched.weights
        steps_ = Steps(launched.engine, max(rows), programs.dims.vocab)
        log("warming up every shape …")
        for n in rows:
            steps_.decode(n)
        for t in prefills:
            steps_.prefill(t)
        bandwidth, decodes, prefill_runs = [], {n: [] for n in rows}, {t: [] for t in prefills}
        products: dict[int, list[Products]] = {n: [] for n in rows}
        for i in range(repeats):
            log(f"turn {i + 1}/{repeats}: bandwidth, decode at {', '.join(map(str, rows))} rows (timed, then "
                f"its products timed), prefill of {', '.join(map(str, prefills))} tokens …")
            bandwidth.append(meter.measure())
            for n in rows:
                decodes[n] += [steps_.decode(n) for _ in range(steps)]
                products[n].append(steps_.products(n, steps))
            for t in prefills:
                prefill_runs[t].append(steps_.prefill(t))
        bw = best(bandwidth)
        result: dict[str, Any] = {
            "preset": preset, "backend": backend, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "cpu": _cpu_model(), "bandwidth_gbs": round(bw.read_gbs, 2), "triad_gbs": round(bw.triad_gbs, 2),
            "bandwidth_runs": [b.to_json() for b in bandwidth], "prompt": PROMPT, "decode": {}, "prefill": {},
            "targets": {"decode_share_1": DECODE_TARGET, "step_8_vs_1": STEP_8_TARGET,
                        "prefill_share_1024": PREFILL_TARGET}}
        for n, samples in decodes.items():
            result["decode"][n] = _decode_figures(programs, weights, n, samples, bw.read_gbs * 1e9,
                                                  products[n], steps)
        rates = None
        for t, samples in prefill_runs.items():
            sample = _median_sample(samples)
            cost = prefill_flops(programs, weights, t, _expert_rows(sample["routing"], programs.dims.experts))
            rates = gemm_rates({shape for _, shape in cost.gemms} - set(rates or {})) | (rates or {})
            result["prefill"][t] = _prefill_figures(cost, sample, samples, rates)
    finally:
        meter.close()
        launched.close()
    for n in rows:
        result[f"decode_share_{n}"] = result["decode"][n]["share"]
        result[f"products_ceiling_{n}"] = result["decode"][n]["products"]["ceiling"]
        if n > 1 and 1 in result["decode"]:
            result[f"step_{n}_vs_1"] = round(result["decode"][n]["seconds"] / result["decode"][1]["seconds"], 3)
    for t in prefills:
        result[f"prefill_share_{t}"] = result["prefill"][t]["share"]
    return result


def _decode_figures(programs, weights, rows: int, samples: list[dict], bandwidth: float,
                    products: list[Products], steps: int) -> dict[str, Any]:
    sample = _median_sample(samples)
    picked = [int(r.unique().numel()) for r in sample["routing"]]
    cost = decode_bytes(programs, weights, [PROMPT] * rows, picked)
    families = {}
    for family in FAMILIES:
        moved = cost.by_family.get(family, 0.0) + (cost.by_family.get(KV, 0.0) if family == LAYER else 0.0)
        spent = sample["families"].get(family, 0.0)
        families[family] = {"bytes": int(moved), "seconds": round(spent, 6),
                            "gbs": round(moved / spent / 1e9, 2) if spent else None,
                            "share": _share(moved / bandwidth, spent)}
    engine = sample["seconds"] - sum(sample["families"].values())
    made = _products_figures(products, steps, cost.by_family.get(EXPERTS, 0.0), cost.total / bandwidth)
    return {"rows": rows, "bytes": int(cost.total), "bytes_by_family": {k: int(v) for k, v in cost.by_family.items()},
            "seconds": round(sample["seconds"], 6), "seconds_spread": _spread(samples),
            "bound_s": round(cost.total / bandwidth, 6), "share": _share(cost.total / bandwidth, sample["seconds"]),
            "families": families, "engine_s": round(engine, 6), "experts_picked": picked,
            "least_efficient": _least(families), "products": made,
            "rest_s": round(sample["seconds"] - engine - made["seconds"], 6)}


def _products_figures(runs: list[Products], steps: int, expert_bytes: float, bound_s: float) -> dict[str, Any]:
    """A step's native products (the mean of `runs`, each of `steps` steps): seconds, bytes and GB/s
    of the dense calls and the experts' (the bytes of the experts its rows picked), and the share
    of the step's bandwidth bound a step of nothing but these products would reach (`ceiling`): the
    most these kernels allow, whatever the rest of the step."""
    n = max(1, steps * len(runs))
    each = Products(*(sum(getattr(r, f.name) for r in runs) / n for f in fields(Products)))  # a step's
    experts_bytes = expert_bytes if each.experts_calls else 0.0
    return {"dense_s": round(each.dense_s, 6), "dense_bytes": int(each.dense_bytes),
            "dense_calls": round(each.dense_calls, 1),
            "dense_gbs": round(each.dense_bytes / each.dense_s / 1e9, 2) if each.dense_s else None,
            "experts_s": round(each.experts_s, 6), "experts_bytes": int(experts_bytes),
            "experts_calls": round(each.experts_calls, 1),
            "experts_gbs": round(experts_bytes / each.experts_s / 1e9, 2) if each.experts_s else None,
            "seconds": round(each.dense_s + each.experts_s, 6),
            "ceiling": _share(bound_s, each.dense_s + each.experts_s)}


def _expert_rows(routing: list, experts: int) -> list[list[int]]:
    """Each layer's rows per expert, from its choices [rows, top-k]."""
    import torch

    return [torch.bincount(r.reshape(-1), minlength=experts).tolist() for r in routing]


def _prefill_figures(cost, sample: dict, samples: list[dict], rates: dict) -> dict[str, Any]:
    families = {}
    for family in (LAYER, EXPERTS, HEAD):
        ideal, spent = gemm_seconds(cost, rates, family), sample["families"].get(family, 0.0)
        families[family] = {"flops": cost.by_family.get(family, 0.0), "seconds": round(spent, 6),
                            "gflops": round(cost.by_family.get(family, 0.0) / spent / 1e9, 2) if spent else None,
                            "gemm_s": round(ideal, 6), "share": _share(ideal, spent)}
    ideal = gemm_seconds(cost, rates)
    return {"flops": cost.total, "attention_flops": cost.attention_flops, "seconds": round(sample["seconds"], 6),
            "seconds_spread": _spread(samples), "gemm_s": round(ideal, 6),
            "gemm_gflops": round(cost.total / ideal / 1e9, 2), "share": _share(ideal, sample["seconds"]),
            "families": families, "engine_s": round(sample["seconds"] - sum(sample["families"].values()), 6),
            "least_efficient": _least(families)}


def _least(families: dict[str, dict]) -> str:
    """The family that loses the most time to its bound (seconds beyond bound seconds): the part of
    the step worth making faster (a family of a few bytes may have a lower share and cost nothing)."""
    lost = [(f["seconds"] * (1 - f["share"]), name) for name, f in families.items()
            if f["share"] is not None and f["seconds"] > 0]
    return max(lost)[1] if lost else ""


def _spread(samples: list[dict]) -> list[float]:
    seconds = sorted(s["seconds"] for s in samples)
    return [round(seconds[0], 6), round(statistics.median(seconds), 6), round(seconds[-1], 6)]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def tables(r: dict[str, Any]) -> list[tuple[str, list[str], list[list]]]:
    """The decode and prefill tables, then each one's split by family."""
    mb = 1e6
    decode_rows = []
    for n, d in r["decode"].items():
        target = f"≥ {r['targets']['decode_share_1']:.0%}" if n == 1 else ""
        vs = r.get(f"step_{n}_vs_1")
        decode_rows.append([f"decode, {n} row{'s' if n > 1 else ''}", f"{d['bytes'] / mb:.1f}",
                            f"{d['bound_s'] * 1e3:.2f}", f"{d['seconds'] * 1e3:.2f}",
                            "-".join(f"{s * 1e3:.1f}" for s in d["seconds_spread"][::2]),
                            f"{d['share']:.1%}", target, f"{vs}×" if vs and n > 1 else "", d["least_efficient"]])
    main = (f"{r['preset']} ({r['backend']}), {r['threads']} threads on {r['cpus']} CPUs ({r['cpu']}): read "
            f"{r['bandwidth_gbs']} GB/s, triad {r['triad_gbs']} GB/s — decode against the bandwidth bound",
            ["step", "MB read", "bound ms", "ms (median)", "ms min-max", "share", "target", "vs 1 row",
             "least efficient"], decode_rows)
    prefill_rows = []
    for t, p in r["prefill"].items():
        target = f"≥ {r['targets']['prefill_share_1024']:.0%}" if t == 1024 else ""
        prefill_rows.append([f"prefill, {t} tokens", f"{p['flops'] / 1e9:.1f}", f"{p['attention_flops'] / 1e9:.2f}",
                             f"{p['gemm_gflops']}", f"{p['gemm_s'] * 1e3:.1f}", f"{p['seconds'] * 1e3:.1f}",
                             f"{p['share']:.1%}", target, p["least_efficient"]])
    prefill = ("prefill against the GEMM bound (float32 GEMM rate at each shape its weights multiply)",
               ["step", "GFLOP (weights)", "GFLOP (attention)", "GEMM GFLOP/s", "bound ms", "ms (median)", "share",
                "target", "least efficient"], prefill_rows)
    made_rows = []
    for n, d in r["decode"].items():
        m = d["products"]
        made_rows.append([f"decode, {n} row{'s' if n > 1 else ''}", f"{d['seconds'] * 1e3:.2f}", f"{d['share']:.1%}",
                          f"{m['dense_s'] * 1e3:.2f}", m["dense_gbs"], f"{m['experts_s'] * 1e3:.2f}", m["experts_gbs"],
                          f"{d['rest_s'] * 1e3:.2f}", f"{d['engine_s'] * 1e3:.2f}",
                          "" if m["ceiling"] is None else f"{m['ceiling']:.1%}"])
    made = ("what a decode step is made of: its native products (dense: the layers' and the head's FP8 and BF16 "
            "calls; experts: the routed experts' calls), the programs' other work, the engine; ceiling: the share "
            "of the bound a step of these products alone would reach",
            ["step", "ms (median)", "share", "dense ms", "dense GB/s", "experts ms", "experts GB/s",
             "other work ms", "engine ms", "products' ceiling"], made_rows)
    split_rows = []
    for n, d in r["decode"].items():
        for family, f in d["families"].items():
            split_rows.append([f"decode {n}", family, f"{f['bytes'] / mb:.2f}", f"{f['seconds'] * 1e3:.2f}",
                               f["gbs"], "" if f["share"] is None else f"{f['share']:.1%}"])
        split_rows.append([f"decode {n}", "engine around the programs", "", f"{d['engine_s'] * 1e3:.2f}", "", ""])
    for t, p in r["prefill"].items():
        for family, f in p["families"].items():
            split_rows.append([f"prefill {t}", family, f"{f['flops'] / 1e9:.2f} GFLOP", f"{f['seconds'] * 1e3:.2f}",
                               f["gflops"], "" if f["share"] is None else f"{f['share']:.1%}"])
        split_rows.append([f"prefill {t}", "engine around the programs", "", f"{p['engine_s'] * 1e3:.2f}", "", ""])
    split = ("by program family (layer: attention + shared expert + routing, with the KV rows; experts: the "
             "routed; decode: bytes and GB/s; prefill: FLOPs and GFLOP/s)",
             ["step", "family", "MB / GFLOP", "ms", "GB/s or GFLOP/s", "share"], split_rows)
    return [main, made, prefill, split]


def main(preset: str = "small", backend: str = "aoti", json_output: bool = False, products: bool = False) -> int:
    from bench.report import print_json, print_table

    log = (lambda s: None) if json_output else (lambda s: print(s, file=sys.stderr, flush=True))
    if products:  # the native products alone (`bench.products_bench`)
        from bench.products_bench import measure as measure_products
        from bench.products_bench import table

        r = measure_products(log=log)
        if json_output:
            print_json({**r, "cpu": _cpu_model(), "load_average": round(os.getloadavg()[0], 2)})
        else:
            print_table(*table(r))
            print(f"{_cpu_model()}; load average {round(os.getloadavg()[0], 2)}")
        return 0
    r = measure(preset, backend, log=log)
    if json_output:
        print_json({**r, "decode": {str(k): v for k, v in r["decode"].items()},
                    "prefill": {str(k): v for k, v in r["prefill"].items()}})
    else:
        for t in tables(r):
            print_table(*t)
        print(f"load average {round(os.getloadavg()[0], 2)} on {r['cpus']} CPUs")
    return 0

