"""`dsv4 bench compile`: a cold compile of a launch's programs in both program forms, one run.

The baseline is the form before issue 37 (`ROUTED_IN_LAYER`: each layer program with its routed
experts inside, picked and dense ways under one `torch.cond`); the new form (`ROUTED_APART`: the
layer programs stop before their routed experts, and `experts.picked` serves every layer; more rows
than it suits are grouped by expert, eagerly). Both are the preset's launch (ranks 1, the launch's
max_seq), compiled by the launch's own compile pool (`--jobs`: the same workers for both) into an
empty kernel cache and an empty Inductor cache each, so neither reuses the other's kernels. Then,
from those caches, each form serves greedy tokens (which must be equal) and decode steps of 1 and 8
sequences, the forms taking turns.

Target (issue 37): the programs phase ≤ 0.7× the baseline's. Reported, never asserted. On a shared
machine the load average beside each form says how much the figures are worth.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TARGET = 0.7  # programs phase, new form ÷ baseline
BASELINE, NEW = "baseline", "new"
PROMPT, NEW_TOKENS, STEPS = [5, 6, 7, 8, 9, 10, 11, 12], 16, 20
BATCH = 8  # sequences of the batched decode step (rows × top-k ≥ experts: the dense way)


def _forms() -> dict[str, str]:
    from runtime.programs.catalog import ROUTED_APART, ROUTED_IN_LAYER

    return {BASELINE: ROUTED_IN_LAYER, NEW: ROUTED_APART}


def _family(name: str) -> str:
    return name.split(".")[0]  # layer | experts | embed | head | mtp


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _compile(specs: dict[str, Any], root: Path, backend: str, jobs: int) -> dict[str, Any]:
    """Every program compiled by a compile pool into an empty cache (its own Inductor cache too)."""
    from runtime.programs.pool import CompilePool

    inductor = root / "inductor"
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)  # the workers' (inherited)
    load_before = os.getloadavg()[0]
    pool = CompilePool(root / "programs", backend, "cpu", jobs=jobs)
    started = time.perf_counter()
    try:
        done = pool.run(list(specs.values()), history={})
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    wall = time.perf_counter() - started
    failed = {n: c.error for n, c in done.items() if not c.ok}
    if failed:
        raise RuntimeError(f"compile failed: {failed}")
    seconds = {n: round(done[n].seconds, 2) for n in specs}
    families: dict[str, float] = {}
    for name, s in seconds.items():
        families[_family(name)] = round(families.get(_family(name), 0.0) + s, 2)
    longest = max(seconds, key=seconds.get)
    return {"programs_s": round(wall, 2), "compile_s_sum": round(sum(seconds.values()), 2),
            "longest": longest, "longest_s": seconds[longest], "programs": len(specs), "families_s": families,
            "program_s": seconds, "peak_rss": max(c.peak_rss for c in done.values()),
            "artifact_bytes": _tree_bytes(root / "programs"), "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2)}


def _alternating(fns: dict[str, Callable[[], Any]], runs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _serve(model: Path, layout: Any, max_seq: int, forms: dict[str, Any], backend: str) -> dict[str, dict]:
    """From each form's cache: greedy tokens, and decode steps of 1 and BATCH sequences (medians)."""
    import torch

    from runtime.engine.engine import Engine
    from runtime.programs.build import prepare
    from runtime.programs.calls import engine_runners
    from runtime.programs.spec import fuses
    from runtime.weights.pack import pack_in_memory
    from runtime.weights.views import packed_views
    from store.checkpoint import Checkpoint
    from store.kernel_cache import KernelCache

    ckpt = Checkpoint.open(model)
    try:
        weights = packed_views(layout, pack_in_memory(ckpt, layout))
    finally:
        ckpt.close()
    engines = {}
    for name, (programs, root) in forms.items():
        cache = KernelCache(root / "programs")
        table = {n: prepare(s, cache=cache, backend=backend).run for n, s in programs.specs.items()}
        engines[name] = Engine(programs, weights, engine_runners(programs, table, fuses(backend)), slots=BATCH)
    out: dict[str, dict] = {name: {"greedy": list(e.generate(PROMPT, NEW_TOKENS))} for name, e in engines.items()}
    for e in engines.values():
        for slot in range(BATCH):
            e.reset(slot)
            e.forward(torch.tensor([slot + 1, slot + 2, slot + 3]), slot)
    one = _alternating({n: (lambda e=e: e.step([(0, torch.tensor([7]))])) for n, e in engines.items()}, STEPS)
    batch = [(slot, torch.tensor([7])) for slot in range(BATCH)]
    many = _alternating({n: (lambda e=e: e.step(batch)) for n, e in engines.items()}, STEPS)
    for name in engines:
        out[name].update(decode_1_s=statistics.median(one[name]), decode_8_s=statistics.median(many[name]))
    return out


def measure(preset: str, backend: str, jobs: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    from runtime.launch.spec import LaunchSpec
    from runtime.model.config import load_config
    from runtime.programs.catalog import build_programs
    from runtime.programs.pool import default_jobs
    from runtime.synth.checkpoint import ensure_default_model
    from runtime.weights.layout import PackedLayout

    model, _ = ensure_default_model(preset)
    launch = LaunchSpec(model, backend=backend, device="cpu")
    layout = PackedLayout(load_config(model), launch.ranks)
    jobs = jobs or default_jobs()
    result: dict[str, Any] = {"preset": preset, "backend": backend, "jobs": jobs, "max_seq": launch.max_seq,
                              "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-compile-") as tmp:
        forms = {}
        for name, form in _forms().items():
            programs = build_programs(layout.config, layout, launch.max_seq, routed=form)
            root = Path(tmp) / name
            log(f"{name} ({form}): compiling {len(programs.specs)} programs cold with {jobs} workers …")
            result[name] = {"form": form, **_compile(programs.specs, root, backend, jobs)}
            log(f"  {result[name]['programs_s']:.1f} s (load average {result[name]['load_before']} → "
                f"{result[name]['load_after']})")
            forms[name] = (programs, root)
        log("greedy tokens and decode steps from both caches, the forms taking turns …")
        for name, figures in _serve(model, layout, launch.max_seq, forms, backend).items():
            result[name].update(figures)
    base, new = result[BASELINE]["programs_s"], result[NEW]["programs_s"]
    result.update(programs_s=new, baseline_programs_s=base, ratio=round(new / base, 3) if base else None,
                  target=TARGET, tokens_equal=result[BASELINE]["greedy"] == result[NEW]["greedy"])
    return result


def main(preset: str = "small", backend: str = "aoti", jobs: int | None = None, json_output: bool = False) -> int:
    from bench.report import print_json, print_table

    r = measure(preset, backend, jobs, log=(lambda s: None) if json_output else print)
    if json_output:
        print_json(r)
    else:
        print_table(*table(r))
    return 0


def table(r: dict[str, Any]) -> tuple[str, list[str], list[list]]:
    """The side-by-side table of `measure`'s result: (title, columns, rows)."""
    old, new = r[BASELINE], r[NEW]
    mib = 2**20

    def row(label: str, a: float, b: float, fmt: str, target: float | None = None) -> list:
        if not a:  # none in the baseline (its experts are inside its layer programs)
            return [label, fmt.format(a), fmt.format(b), "", "", ""]
        verdict = "" if target is None else ("met" if b / a <= target else "MISSED")
        return [label, fmt.format(a), fmt.format(b), f"{b / a:.2f}×", f"≤ {target}×" if target else "", verdict]

    rows = [
        row("programs phase (s, pool wall)", old["programs_s"], new["programs_s"], "{:.1f}", TARGET),
        row("compile seconds summed", old["compile_s_sum"], new["compile_s_sum"], "{:.1f}"),
        *(row(f"  {fam} programs (s summed)", old["families_s"].get(fam, 0.0), new["families_s"].get(fam, 0.0),
              "{:.1f}") for fam in dict.fromkeys([*old["families_s"], *new["families_s"]])),
        ["longest program (s)", f"{old['longest_s']:.1f} {old['longest']}", f"{new['longest_s']:.1f} {new['longest']}",
         f"{new['longest_s'] / old['longest_s']:.2f}×" if old["longest_s"] else "", "", ""],
        ["programs", old["programs"], new["programs"], "", "", ""],
        row("artifacts (MiB)", old["artifact_bytes"] / mib, new["artifact_bytes"] / mib, "{:,.1f}"),
        row("peak RSS of a worker (MiB)", old["peak_rss"] / mib, new["peak_rss"] / mib, "{:,.0f}"),
        row("decode step, 1 sequence (ms)", old["decode_1_s"] * 1e3, new["decode_1_s"] * 1e3, "{:.2f}"),
        row(f"decode step, {BATCH} sequences (ms)", old["decode_8_s"] * 1e3, new["decode_8_s"] * 1e3, "{:.2f}"),
        ["load average (before → after)", f"{old['load_before']} → {old['load_after']}",
         f"{new['load_before']} → {new['load_after']}", "", "", ""],
        ["greedy tokens equal", "", "", "", "", "yes" if r["tokens_equal"] else "NO"],
    ]
    return (f"cold compile of the {r['preset']} launch's programs, {r['backend']}, {r['jobs']} workers on "
            f"{r['cpus']} CPUs — ratio: new form against the baseline (lower is faster)",
            ["figure", f"baseline ({old['form']})", f"new ({new['form']})", "ratio", "target", ""], rows)
