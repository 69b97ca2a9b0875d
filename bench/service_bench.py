"""`dsv4 bench service`: the one-sequence-per-step engine vs continuous batching, side by side.

Same checkpoint (tiny), same programs, same load: each engine is a real `dsv4 serve` on
loopback (`--max-slots 64`; the baseline adds `--max-batch 1`, so one sequence runs per step),
and 64 concurrent clients send ROUNDS rounds of streamed completions (greedy, MAX_TOKENS each).
Printed per engine: throughput (completion tokens/s, requests/s), p50/p99 latency, p50 time to
first token, the server's peak RSS, and the engine's mean batch and MTP figures from /health;
then the ratios against the baseline. A third server speculates with MTP (`--speculative mtp`;
the synthetic MTP layer drafts badly, so it shows the cost and the tokens-per-step figure, not
a speed-up).

On the batched server, two more loads: all greedy vs half the requests sampled (top_p, top_k,
min_p and every penalty set, seeded; target ≥ 0.9×), one 128-token prompt answered four times
as `n=4` choices of one request (one prefill, copied) vs as four separate requests, and eight
prompts as one request's batch (`prompt: [[…], …]`, what lm-eval sends) vs as eight requests at
once (target: within 10 %).

Decode step time: one engine in this process at max_seq 256 and 4096, a 200-token prompt, then
timed single-sequence decode steps: the incremental compressed KV keeps them close.
Reported, never asserted.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from runtime.contract import Health

CLIENTS, ROUNDS, MAX_TOKENS = 64, 2, 16
TARGETS = {"throughput": 10.0, "p99": 5.0, "step_4096_vs_256": 2.0, "sampled_vs_greedy": 0.9,
           "batch_vs_requests": 0.9}
ENGINES = {"one-at-a-time": ("--max-batch", "1"), "batched": (), "batched+mtp": ("--speculative", "mtp")}


def _start(model_dir: Path, tmp: Path, backend: str, *extra: str, cache_dir: Path | None = None,
           max_seq: int = 256, slots: int = CLIENTS, env: dict[str, str] | None = None,
           ) -> tuple[subprocess.Popen, str]:
    """A `dsv4 serve` on loopback (its events under `tmp`, programs in `cache_dir`, default beside
    `tmp`), once it serves: (process, url)."""
    events = tmp / "events.jsonl"
    cache_dir = cache_dir or tmp.parent / "programs"
    proc = subprocess.Popen([sys.executable, "-m", "console.cli", "serve", str(model_dir), "--backend", backend,
                             "--kernel-cache-dir", str(cache_dir), "--device", "cpu", "--port", "0",
                             "--max-seq", str(max_seq), "--max-slots", str(slots), "--queue-timeout", "3600",
                             "--events", str(events), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **(env or {})})
    deadline = time.time() + 900
    while time.time() < deadline and proc.poll() is None:
        if events.exists():
            for line in events.read_text().splitlines():
                e = json.loads(line)
                if e.get("phase") == "serve" and e.get("kind") == "end":
                    return proc, e["detail"]["url"]
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"dsv4 bench: the server did not start (its events: {events})")


def _body(i: int) -> dict[str, Any]:
    """The load's request: an 8-token prompt, MAX_TOKENS greedy tokens, streamed."""
    return {"prompt": [1 + i % 13, 2 + i % 5, 3, 4, 5, 6, 7, 8], "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True}


def _request(url: str, i: int, body: dict[str, Any] | None = None) -> tuple[float, float, int]:
    """One streamed completion: (latency, time to first token, completion tokens of every choice)."""
    import httpx

    body = body or _body(i)
    t0 = time.perf_counter()
    first, tokens = None, 0
    with httpx.Client(timeout=600) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids = [t for choice in json.loads(line[6:])["choices"] for t in choice.get("token_ids") or []]
                if ids and first is None:
                    first = time.perf_counter() - t0
                tokens += len(ids)
    return time.perf_counter() - t0, first or 0.0, tokens


SAMPLED = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.02, "presence_penalty": 0.5,
           "frequency_penalty": 0.2, "repetition_penalty": 1.1}
CHOICES, LONG_PROMPT = 4, 128
BATCH = 8  # prompts of one batched request


def _drive(url: str, bodies: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda ib: _request(url, ib[0], ib[1]), enumerate(bodies)))
    wall = time.perf_counter() - t0
    tokens = sum(r[2] for r in results)
    return {"requests": len(bodies), "tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 1)}


def mixes(url: str) -> dict[str, dict[str, Any]]:
    """On one batched server: all greedy vs half the requests sampled (every sampling parameter
    set, seeded); one prompt of LONG_PROMPT tokens answered CHOICES times, as `n` choices of
    one request (one prefill) vs as CHOICES separate requests; BATCH prompts as one request's
    batch vs as BATCH requests at once (the same sequences, CLIENTS of them in flight)."""
    greedy = [_body(i) for i in range(CLIENTS * ROUNDS)]
    mixed = [b if i % 2 else {**b, **SAMPLED, "seed": i} for i, b in enumerate(greedy)]
    prompt = [(7 * i) % 200 + 3 for i in range(LONG_PROMPT)]
    long = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 1, "stream": True,
            "ignore_eos": True}
    groups = CLIENTS // CHOICES
    singles = [{**_body(i), "ignore_eos": True} for i in range(BATCH)]
    batch = {**singles[0], "prompt": [b["prompt"] for b in singles]}
    batches = CLIENTS // BATCH
    return {"all greedy": _drive(url, greedy, CLIENTS), "half sampled": _drive(url, mixed, CLIENTS),
            f"{CHOICES} requests": _drive(url, [long] * (groups * CHOICES), CLIENTS),
            f"n={CHOICES}": _drive(url, [{**long, "n": CHOICES}] * groups, groups),
            f"{BATCH} requests": _drive(url, singles * batches, CLIENTS),
            f"batch of {BATCH}": _drive(url, [batch] * batches, batches)}


def _load(url: str, pid: int) -> dict[str, Any]:
    import httpx
    import psutil

    proc, peak, done = psutil.Process(pid), [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], proc.memory_info().rss)

    threading.Thread(target=watch, daemon=True).start()
    results: list[tuple[float, float, int]] = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(CLIENTS) as pool:
        for _ in range(ROUNDS):
            results += pool.map(lambda i: _request(url, i), range(CLIENTS))
    wall = time.perf_counter() - t0
    done.set()
    engine = Health.from_json(httpx.get(f"{url}/health").json()).engine  # the contract's value, not keys
    lat = sorted(r[0] for r in results)
    return {"requests": len(results), "tokens": sum(r[2] for r in results), "wall_s": round(wall, 2),
            "tokens_per_s": round(sum(r[2] for r in results) / wall, 1),
            "requests_per_s": round(len(results) / wall, 2),
            "p50_s": round(statistics.median(lat), 3), "p99_s": round(lat[int(0.99 * (len(lat) - 1))], 3),
            "ttft_p50_s": round(statistics.median(r[1] for r in results), 3), "peak_rss_mib": peak[0] >> 20,
            "mean_batch": engine.get("mean_batch"), "acceptance": engine.get("acceptance"),
            "tokens_per_step": engine.get("tokens_per_step")}


def step_times(model_dir: Path, steps: int = 40) -> dict[int, float]:
    """Median single-sequence decode step (seconds) after a 200-token prompt, eager, per max_seq."""
    import torch

    from runtime.engine.engine import Engine
    from runtime.model.config import load_config
    from runtime.programs.catalog import build_programs
    from runtime.weights.layout import PackedLayout
    from runtime.weights.pack import pack_in_memory
    from runtime.weights.views import packed_views
    from store.checkpoint import Checkpoint

    config = load_config(model_dir)
    layout = PackedLayout(config, ranks=1)
    weights = packed_views(layout, pack_in_memory(Checkpoint.open(model_dir), layout))
    out = {}
    for max_seq in (256, 4096):
        engine = Engine(build_programs(config, layout, max_seq), weights)
        engine.forward(torch.arange(200) % config.vocab_size)
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            engine.forward(torch.tensor([i % config.vocab_size]))
            times.append(time.perf_counter() - t0)
        out[max_seq] = statistics.median(times)
    return out


def measure(backend: str, progress=print) -> dict[str, Any]:
    from runtime.synth.checkpoint import synthesize

    rows = {}
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-service-") as tmp:
        model = synthesize("tiny", Path(tmp) / "ckpt", seed=0)
        for name, extra in ENGINES.items():
            progress(f"{name}: starting dsv4 serve …")
            run_dir = Path(tmp) / name
            run_dir.mkdir()
            proc, url = _start(model, run_dir, backend, *extra)
            try:
                progress(f"{name}: {CLIENTS} clients × {ROUNDS} rounds …")
                rows[name] = _load(url, proc.pid)
                if name == "batched":
                    progress(f"{name}: greedy vs sampled, n={CHOICES} vs {CHOICES} requests, "
                             f"a batch of {BATCH} vs {BATCH} requests …")
                    mix = mixes(url)
            finally:
                proc.terminate()
                proc.wait(timeout=120)
        progress("decode step time at max_seq 256 and 4096 …")
        steps = step_times(model)
    base, batched = rows["one-at-a-time"], rows["batched"]
    ratios = {"throughput": round(batched["tokens_per_s"] / base["tokens_per_s"], 2),
              "p99": round(base["p99_s"] / batched["p99_s"], 2),
              "step_4096_vs_256": round(steps[4096] / steps[256], 2),
              "sampled_vs_greedy": round(mix["half sampled"]["tokens_per_s"] / mix["all greedy"]["tokens_per_s"], 2),
              "n_vs_requests": round(mix[f"n={CHOICES}"]["tokens_per_s"]
                                     / mix[f"{CHOICES} requests"]["tokens_per_s"], 2),
              "batch_vs_requests": round(mix[f"batch of {BATCH}"]["tokens_per_s"]
                                         / mix[f"{BATCH} requests"]["tokens_per_s"], 2)}
    return {"backend": backend, "clients": CLIENTS, "rounds": ROUNDS, "max_tokens": MAX_TOKENS, "rows": rows,
            "mix": mix, "step_s": {str(k): round(v, 5) for k, v in steps.items()}, "ratios": ratios, "targets": TARGETS,
            "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}


def main(backend: str = "export", json_output: bool = False) -> int:
    from bench.report import print_json, print_table

    result = measure(backend, progress=(lambda *_: None) if json_output else
                     (lambda m: print(m, file=sys.stderr, flush=True)))
    if json_output:
        print_json(result)
        return 0
    keys = ("tokens_per_s", "requests_per_s", "p50_s", "p99_s", "ttft_p50_s", "peak_rss_mib", "mean_batch",
            "acceptance", "tokens_per_step")
    rows = result["rows"]
    print_table(f"dsv4 serve, tiny, {backend}: {CLIENTS} clients × {ROUNDS} rounds, {MAX_TOKENS} tokens each",
                ["", *rows], [[k, *(rows[n][k] for n in rows)] for k in keys])
    r, t = result["ratios"], TARGETS
    print_table("batched vs one-at-a-time, and decode step time", ["figure", "measured", "target"], [
        ["throughput (tokens/s) ×", r["throughput"], f"≥ {t['throughput']}"],
        ["p99 latency, baseline / batched", r["p99"], f"≥ {t['p99']}"],
        ["decode step at max_seq 256 (s)", result["step_s"]["256"], ""],
        ["decode step at max_seq 4096 (s)", result["step_s"]["4096"], ""],
        ["step 4096 / 256", r["step_4096_vs_256"], f"≤ {t['step_4096_vs_256']}"],
        ["half sampled vs all greedy (tokens/s) ×", r["sampled_vs_greedy"], f"≥ {t['sampled_vs_greedy']}"],
        [f"n={CHOICES} vs {CHOICES} requests of a {LONG_PROMPT}-token prompt (tokens/s) ×", r["n_vs_requests"], ""],
        [f"a batch of {BATCH} prompts vs {BATCH} requests at once (tokens/s) ×", r["batch_vs_requests"],
         f"≥ {t['batch_vs_requests']}"],
    ])
    mix = result["mix"]
    print_table("batched server: request mixes", ["load", "requests", "tokens", "wall (s)", "tokens/s"],
                [[name, m["requests"], m["tokens"], m["wall_s"], m["tokens_per_s"]] for name, m in mix.items()])
    print(f"load average {result['load_avg_1m']} on {result['cpus']} CPUs")
    return 0
