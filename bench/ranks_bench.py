"""`dsv4 bench ranks`: one service as N rank processes (data-parallel attention, expert-parallel
MoE), for N = 1, 2, 4.

On one synthetic checkpoint and one kernel-cache dir shared by every N, per rank count N
(`dsv4 serve --ranks N` on loopback, cpu/gloo, max_seq 256, 16 KV slots):

  cold    — no sidecar for N; the programs N needs compile unless an earlier N published the
            same keys (each rank's HIT/MISS counts say which): seconds from process start to the
            `serve` `end` event, and the registration phases of rank 0 and of the slowest rank;
  prepack — `dsv4 prepack MODEL --ranks N`, timed; then every page of its sidecar read once;
  hot     — the same launch mapping that hot sidecar, each rank on a simulated device of the
            same size (`--device-memory`: what CAPACITY_SLOTS slots need; --max-slots out of
            the way), so its KV budget decides its slots: start to ready; each rank's mapped
            bytes (the shared weights every rank maps, its own routed-expert slice), slots and
            KV bytes; decode tokens/s with 1, 16 and 32 concurrent streamed greedy completions
            (the service bench's request: an 8-token prompt, 16 tokens; after a warm-up one),
            beside rank 0's seconds in the layers' all-to-alls per engine call; then each rank
            process's PSS and RSS.

Slots at N ranks ÷ slots at one rank, on the same per-device memory, against the target 0.95 × N
(each rank holds only its own sequences' KV).

Host memory added per extra rank = (total PSS over the ranks at N − at 1) / (N − 1), against
the target that the shared weights are not duplicated: at most 5 % of the sidecar plus one
rank's KV (slots × slot_bytes). The launcher process of N > 1 is shown apart, not in the total;
so is the PSS of the ranks' mappings of the sidecar (about the sidecar's size at every N when no
rank duplicates the shared weights), since a process's own baseline (interpreter, torch) counts
in its PSS whatever the weights.

Last, the per-page cost of mapping the hot sidecar in this process (mmap read-only, touch one
byte per 4 KiB page, best of 3), projected onto V4-Flash: each rank maps the shared weights and
1/N of the routed experts, from V4-Flash's packed layout (its real tensor shapes), packer 4's
(FP4 two codes a byte) beside packer 2's (FP4 one int8 a value). Ratios are against N = 1 of the same run; nothing is
asserted but the pass/miss of the memory target is printed.

Starting, driving and stopping the services is `bench.ranks_services`.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.ranks_services import Service, memory_of, prepack, run_load, serving

RANKS = (1, 2, 4)
PAGE = 4096
LOADS = {1: 4, 16: 32, 32: 64}  # concurrent clients → requests sent
CAPACITY_SLOTS = 40  # per rank's device: one rank alone holds the 32 concurrent requests
SLOTS_TARGET = 0.95  # slots at N ranks ≥ this × N × slots at one rank
UTILIZATION = 0.9  # --memory-utilization's default
SIDECAR_SHARE = 0.05  # per extra rank: at most this much of the sidecar, plus that rank's KV
V4_FLASH_SIDECAR_BYTES = round(322.8 * (1 << 30))  # the seed's measured sidecar: 84.6 M pages
V4_FLASH_RANKS = (1, 2, 4, 8)
MAP_RUNS = 3


# ---- the arithmetic (pure) ----

def added_per_rank(total_pss: dict[int, int]) -> dict[int, float]:
    """Host memory each extra rank adds: (total PSS at N − at 1) / (N − 1), for every N > 1."""
    base = total_pss.get(1)
    if base is None:
        return {}
    return {n: (pss - base) / (n - 1) for n, pss in sorted(total_pss.items()) if n > 1}


def slot_ratios(total_slots: dict[int, int]) -> dict[int, dict[str, Any]]:
    """Slots at N ranks ÷ slots at one rank (the same memory per device), against SLOTS_TARGET × N."""
    base = total_slots.get(1)
    return {n: {"slots": slots, "ratio": round(slots / base, 3) if base else None,
                "met": bool(base) and slots >= SLOTS_TARGET * n * base} for n, slots in sorted(total_slots.items())}


def rank_memory_target(sidecar_bytes: int, slots: int, slot_bytes: int) -> int:
    """What one extra rank may add when the shared weights are not duplicated."""
    return round(SIDECAR_SHARE * sidecar_bytes) + slots * slot_bytes


def v4_flash_projection(per_page_s: float, expert_share: float, sidecar_bytes: int = V4_FLASH_SIDECAR_BYTES,
                        ranks: Sequence[int] = V4_FLASH_RANKS) -> list[dict[str, float]]:
    """Pages one rank maps (the shared weights + 1/N of the experts) and what mapping them costs."""
    experts = sidecar_bytes * expert_share
    rows = []
    for n in ranks:
        nbytes = sidecar_bytes - experts + experts / n
        pages = math.ceil(nbytes / PAGE)
        rows.append({"ranks": n, "bytes": round(nbytes), "pages": pages, "seconds": pages * per_page_s})
    return rows


def v4_flash_expert_share(packer: int = 4) -> tuple[float, int]:
    """The routed experts' share of V4-Flash's packed layout, and that layout's size in bytes:
    this packer's (4; 3's bytes were as many), or packer 2's, whose FP4 codes took a byte each (twice the bytes)."""
    from runtime.model.config import from_dict
    from runtime.synth.checkpoint import V4_FLASH
    from runtime.weights.layout import EXPERTS, PackedLayout
    from store.checkpoint import DTYPE_SIZES

    layout = PackedLayout(from_dict(V4_FLASH, source="V4-Flash"), ranks=1)

    def nbytes(t: Any) -> int:
        widened = 2 if packer == 2 and t.part == "qweight" and t.dtype == "U8" else 1
        return DTYPE_SIZES[t.dtype] * math.prod(t.shape) * widened

    total = sum(nbytes(t) for t in layout.tensors.values())
    experts = sum(nbytes(t) for t in layout.tensors.values() if t.rule.group == EXPERTS)
    return experts / total, total


def summarize_launch(lines: Sequence[str], started: float) -> dict[str, Any]:
    """One launch's events → time to ready, and per rank: registration phases, programs counts,
    the weights and kv end details. The slowest rank is the one whose registration took longest
    (first event to its last registration `end`)."""
    from runtime.events import REGISTRATION as PHASES

    ranks: dict[int, dict[str, Any]] = {}
    ready = None
    for line in lines:
        e = json.loads(line)
        r = ranks.setdefault(e.get("rank") or 0, {"first": e["ts"], "last": e["ts"], "phases": {}})
        r["first"] = min(r["first"], e["ts"])
        if e["kind"] != "end":
            continue
        detail = e.get("detail") or {}
        if e["phase"] == "serve":
            ready = e["ts"] - started
        elif e["phase"] in PHASES:
            r["phases"][e["phase"]] = e.get("seconds")
            r["last"] = max(r["last"], e["ts"])
        if e["phase"] == "programs":
            r["programs"] = detail.get("counts")
        elif e["phase"] == "weights":
            r["weights"] = {k: detail.get(k) for k in ("path", "reason", "bytes", "shared_bytes", "expert_bytes")}
        elif e["phase"] == "kv":
            r["kv"] = {k: detail.get(k) for k in ("slots", "slot_bytes", "total_bytes")}
    slowest = max(sorted(ranks), key=lambda k: ranks[k]["last"] - ranks[k]["first"]) if ranks else 0
    return {"ready_s": ready, "slowest_rank": slowest,
            "ranks": [{k: v for k, v in ranks[k].items() if k not in ("first", "last")} for k in sorted(ranks)]}


def launch_summary(service: Service) -> dict[str, Any]:
    """`summarize_launch` of a running service's events so far."""
    return summarize_launch(service.events.read_text().splitlines(), service.started)


# ---- mapping cost, in this process ----

def page_cost(path: Path, runs: int = MAP_RUNS) -> dict[str, float]:
    """Seconds per 4 KiB page to map `path` (hot in the page cache) read-only and touch one byte
    of every page, best of `runs`; the unmap is not timed."""
    import numpy as np

    best = math.inf
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for _ in range(runs):
            t0 = time.perf_counter()
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
            view = np.frombuffer(m, np.uint8)
            view[::PAGE].sum()
            best = min(best, time.perf_counter() - t0)
            del view
            m.close()
    pages = -(-size // PAGE)
    return {"pages": pages, "seconds": best, "per_page_s": best / pages}


# ---- the bench ----

def measure(preset: str, backend: str, ranks: Sequence[int], progress: Callable[[str], None]) -> dict[str, Any]:
    from runtime.synth.checkpoint import synthesize
    from store.pagecache import warm

    runs: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-ranks-") as tmp:
        tmp = Path(tmp)
        progress(f"synthesizing the {preset} checkpoint …")
        model, cache = synthesize(preset, tmp / "model"), tmp / "programs"
        sidecars: dict[int, Path] = {}
        for n in ranks:
            run: dict[str, Any] = runs.setdefault(n, {})
            progress(f"N={n} cold: no sidecar for {n}, programs from the shared cache or compiled …")
            with serving(model, cache, tmp / f"r{n}-cold", backend, n) as service:
                run["cold"] = launch_summary(service)
            run["left_behind"] = service.left_behind
            progress(f"N={n}: dsv4 prepack --ranks {n} …")
            run["prepack_s"], sidecars[n] = prepack(model, n)
            run["sidecar_bytes"] = sidecars[n].stat().st_size
            warm(sidecars[n], remember=False)
            progress(f"N={n} hot: mapping the hot sidecar …")
            slot_bytes = run["cold"]["ranks"][0]["kv"]["slot_bytes"]
            device = math.ceil(CAPACITY_SLOTS * slot_bytes / UTILIZATION) + slot_bytes // 2
            options = ("--device-memory", str(device), "--max-slots", "4096")
            with serving(model, cache, tmp / f"r{n}-hot", backend, n, options) as service:
                run_load(service.url, 1, 1)  # warm-up
                run["decode"] = {}
                for clients, requests in LOADS.items():
                    progress(f"N={n} hot: {requests} requests, {clients} at a time …")
                    run["decode"][clients] = run_load(service.url, clients, requests)
                run["hot"] = launch_summary(service)
                run["memory"] = memory_of(service, sidecars[n].resolve())
            run["left_behind"] += service.left_behind
        path = sidecars[ranks[0]]
        warm(path, remember=False)
        progress(f"page-mapping cost of {path.name} …")
        cost = page_cost(path)
    v4 = {}
    for packer in (2, 4):
        share, layout_bytes = v4_flash_expert_share(packer)
        v4[f"packer{packer}"] = {"expert_share": share, "sidecar_bytes": layout_bytes,
                                 "rows": v4_flash_projection(cost["per_page_s"], share, layout_bytes)}
    return {"preset": preset, "backend": backend, "runs": runs, "memory": _memory_verdicts(runs),
            "slots": slot_ratios({n: sum(r["kv"]["slots"] for r in run["hot"]["ranks"]) for n, run in runs.items()}),
            "page_cost": cost, "v4_flash": v4,
            "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}


def _memory_verdicts(runs: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    added = added_per_rank({n: r["memory"]["total_pss"] for n, r in runs.items()})
    out = {}
    for n, per_rank in added.items():
        kv = runs[n]["hot"]["ranks"][0].get("kv") or {}
        target = rank_memory_target(runs[n]["sidecar_bytes"], kv.get("slots") or 0, kv.get("slot_bytes") or 0)
        out[n] = {"added_per_rank": round(per_rank), "target": target, "met": per_rank <= target}
    return out


def parse_ranks(text: str, experts: int) -> tuple[list[int], list[str]]:
    """The rank counts to run (in order, once each) and a line for each one skipped."""
    chosen, skipped = [], []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        n = int(part) if part.isdigit() else 0
        if n < 1 or experts % n:
            skipped.append(f"skipping --ranks {part}: it does not divide the {experts} routed experts")
        elif n not in chosen:
            chosen.append(n)
    return chosen, skipped


def main(preset: str = "small", backend: str = "export", ranks: str = ",".join(map(str, RANKS)),
         json_output: bool = False) -> int:
    from bench.report import print_json
    from runtime.synth.checkpoint import preset_config_dict

    chosen, skipped = parse_ranks(ranks, preset_config_dict(preset)["n_routed_experts"])
    for line in skipped:
        print(line, file=sys.stderr)
    if not chosen:
        raise SystemExit("dsv4 bench ranks: no rank count left to run")
    result = measure(preset, backend, chosen, progress=(lambda *_: None) if json_output else
                     (lambda m: print(m, file=sys.stderr, flush=True)))
    result["skipped"] = skipped
    if json_output:
        print_json(result)
    else:
        _print(result)
    return 0


# ---- the tables ----

def _print(result: dict[str, Any]) -> None:
    from bench.report import print_table
    from runtime.events import REGISTRATION as PHASES
    from store.units import format_size

    runs = result["runs"]
    ns = list(runs)
    base = runs.get(1)

    def vs1(value: float | None, base_value: float | None, fmt: str = "{:.2f}") -> str:
        if value is None:
            return "-"
        text = fmt.format(value)
        return f"{text} ({value / base_value:.2f}×)" if base_value else text

    def per_rank(values: Sequence[Any]) -> str:
        return " · ".join(f"r{i} {v}" for i, v in enumerate(values))

    def figure(n: int, path: Sequence[str]) -> Any:
        value: Any = runs[n]
        for k in path:
            value = value[k]
        return value

    def ratio_row(label: str, path: Sequence[str], fmt: str = "{:.2f}") -> list[str]:
        b = figure(1, path) if base else None
        return [label, *(vs1(figure(n, path), b, fmt) for n in ns)]

    def counts(c: dict | None) -> str:
        return " ".join(f"{k} {v}" for k, v in (c or {}).items() if v) or "-"

    title = f"dsv4 serve --ranks N, preset {result['preset']}, backend {result['backend']} (ratios vs N=1)"
    rows = [
        ratio_row("cold: start → ready (s)", ("cold", "ready_s")),
        ["cold: weights", *(per_rank([r["weights"]["path"] for r in runs[n]["cold"]["ranks"]]) for n in ns)],
        ["cold: programs", *(per_rank([counts(r.get("programs")) for r in runs[n]["cold"]["ranks"]]) for n in ns)],
        ratio_row("prepack --ranks N (s)", ("prepack_s",)),
        ["sidecar", *(format_size(runs[n]["sidecar_bytes"]) for n in ns)],
        ratio_row("hot: start → ready (s)", ("hot", "ready_s")),
        ["hot: cold / hot", *(f"{runs[n]['cold']['ready_s'] / runs[n]['hot']['ready_s']:.1f}×" for n in ns)],
        ["hot: weights", *(per_rank([r["weights"]["path"] for r in runs[n]["hot"]["ranks"]]) for n in ns)],
        ["hot: programs", *(per_rank([counts(r.get("programs")) for r in runs[n]["hot"]["ranks"]]) for n in ns)],
        ["mapped: shared", *(per_rank([format_size(r["weights"]["shared_bytes"]) for r in runs[n]["hot"]["ranks"]])
                             for n in ns)],
        ["mapped: own experts", *(per_rank([format_size(r["weights"]["expert_bytes"])
                                            for r in runs[n]["hot"]["ranks"]]) for n in ns)],
        ["hot: --device-memory per rank", *(format_size(runs[n]["hot"]["ranks"][0]["kv"]["total_bytes"]) for n in ns)],
        ["KV per rank (slots × slot)", *(per_rank([f"{r['kv']['slots']} × {format_size(r['kv']['slot_bytes'])}"
                                                   for r in runs[n]["hot"]["ranks"]]) for n in ns)],
        ["KV bytes per rank", *(per_rank([format_size(r["kv"]["slots"] * r["kv"]["slot_bytes"])
                                          for r in runs[n]["hot"]["ranks"]]) for n in ns)],
        ["slots, all ranks", *(str(result["slots"][n]["slots"]) for n in ns)],
        [f"slots ÷ slots at N=1 (target ≥ {SLOTS_TARGET} × N)",
         *(f"{result['slots'][n]['ratio']:.2f} {'pass' if result['slots'][n]['met'] else 'MISS'}"
           if result["slots"][n]["ratio"] is not None else "-" for n in ns)],
        ["PSS per rank", *(per_rank([format_size(r["pss"]) for r in runs[n]["memory"]["per_rank"]]) for n in ns)],
        ["RSS per rank", *(per_rank([format_size(r["rss"]) for r in runs[n]["memory"]["per_rank"]]) for n in ns)],
        ["PSS total over ranks", *(vs1(runs[n]["memory"]["total_pss"] / (1 << 20),
                                       base and base["memory"]["total_pss"] / (1 << 20), "{:.0f} MiB")
                                   for n in ns)],
        ["sidecar pages mapped per rank", *(per_rank([format_size(r["sidecar_rss"])
                                                      for r in runs[n]["memory"]["per_rank"]]) for n in ns)],
        ["sidecar mapping PSS over ranks", *(vs1(runs[n]["memory"]["sidecar_pss"] / (1 << 20),
                                                 base and base["memory"]["sidecar_pss"] / (1 << 20), "{:.1f} MiB")
                                             for n in ns)],
        ["launcher PSS (not in total)", *(format_size(runs[n]["memory"]["launcher_pss"])
                                          if runs[n]["memory"]["launcher_pss"] else "-" for n in ns)],
    ]
    verdicts = result["memory"]
    rows += [
        ["added per extra rank", *(format_size(verdicts[n]["added_per_rank"]) if n in verdicts else "-" for n in ns)],
        [f"target: {SIDECAR_SHARE:.0%} of sidecar + 1 rank's KV",
         *(f"{format_size(verdicts[n]['target'])} {'pass' if verdicts[n]['met'] else 'MISS'}"
           if n in verdicts else "-" for n in ns)],
        *(ratio_row(f"decode tokens/s, {c} concurrent", ("decode", c, "tokens_per_s"), "{:.1f}") for c in LOADS),
        *([f"mean batch, {c} concurrent", *(str(runs[n]["decode"][c].get("mean_batch")) for n in ns)] for c in LOADS),
        *([f"all-to-all ms / engine call, {c} concurrent",
           *(f"{runs[n]['decode'][c]['exchange_ms_per_call']:.2f} "
             f"({runs[n]['decode'][c]['exchange_share']:.0%} of wall)"
             if "exchange_ms_per_call" in runs[n]["decode"][c] else "-" for n in ns)] for c in LOADS if c > 1),
    ]
    print_table(title, ["", *(f"N={n}" for n in ns)], rows)

    phase_rows = []
    for n in ns:
        for run in ("cold", "hot"):
            s = runs[n][run]
            shown = [(0, "0")] + ([(s["slowest_rank"], f"{s['slowest_rank']} (slowest)")]
                                  if s["slowest_rank"] != 0 else [])
            for rank, label in shown:
                phases = s["ranks"][rank]["phases"]
                phase_rows.append([n, run, label, *(f"{phases.get(p) or 0:.2f}" for p in PHASES),
                                   f"{s['ready_s']:.2f}"])
    print_table("registration phases (seconds): rank 0, and the slowest rank where another",
                ["N", "run", "rank", *PHASES, "start → ready"], phase_rows)

    cost, v4 = result["page_cost"], result["v4_flash"]
    old, new = v4["packer2"], v4["packer4"]
    print_table(f"mapping cost per rank at V4-Flash scale: packer 2's {old['sidecar_bytes'] / (1 << 30):.1f} GiB "
                f"sidecar vs packer 4's {new['sidecar_bytes'] / (1 << 30):.1f} GiB (routed experts "
                f"{new['expert_share']:.1%}), {cost['per_page_s'] * 1e9:.0f} ns a page",
                ["N", "GiB / rank (2)", "GiB / rank (4)", "M pages (2)", "M pages (4)", "s / rank (2)",
                 "s / rank (4)", "4 vs 2"],
                [[a["ranks"], f"{a['bytes'] / (1 << 30):.1f}", f"{b['bytes'] / (1 << 30):.1f}",
                  f"{a['pages'] / 1e6:.1f}", f"{b['pages'] / 1e6:.1f}", f"{a['seconds']:.1f}", f"{b['seconds']:.1f}",
                  f"{b['pages'] / a['pages']:.2f}×"] for a, b in zip(old["rows"], new["rows"], strict=True)])
    print(f"per-page cost: map + touch of {cost['pages']:,} hot pages in {cost['seconds'] * 1e3:.1f} ms "
          f"(best of {MAP_RUNS}); the reference deployment's {V4_FLASH_SIDECAR_BYTES / (1 << 30):.1f} GiB "
          f"sidecar was {V4_FLASH_SIDECAR_BYTES / PAGE / 1e6:.1f} M pages in every serving process.")
    print(f"load average {result['load_avg_1m']} on {result['cpus']} CPUs")
