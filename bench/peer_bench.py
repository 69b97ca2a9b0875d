"""`dsv4 bench peer`: our `dsv4 serve` against Hugging Face transformers' generate, same weights.

The baseline is transformers' `DeepseekV4ForCausalLM` (bench/hf_peer.py: float32, the
checkpoint dequantised by our code, KV cache on, greedy); the service is a real `dsv4 serve`
of the same checkpoint on loopback (`--backend`, default aoti: the service's own on the cpu;
programs from the user's kernel cache, compiled on the first run). Same prompts (PROMPT_TOKENS
tokens each, all of one length so the peer's batch needs no padding), NEW_TOKENS greedy tokens,
1 request and CONCURRENT at once: the service gets them as streamed /v1/completions
(`ignore_eos`), the peer as one `generate` of a batch. Both run on the same torch threads, never
at the same time: after a warm-up of every shape, the sides take turns REPEATS times, and each
side's run of median decode tokens/s counts.
A first token is one step, which this machine's speed (it swings by up to 1.6x within minutes)
moves as much as any change to it: each side's time to first token is the median of its runs'
and of TTFT_ROUNDS more first tokens alone (the service: a one-token request; the peer: a
`generate` of one token). Within a turn the side that goes first alternates, so neither always
follows the other's heaviest run.

Per side and concurrency: time to first token (the service: each request's first streamed
token, median; the peer: a `generate` of one new token) and decode tokens/s (the tokens after
the first ÷ the seconds after the first token; of several sequences, all of them over the
wall). Ratios are service ÷ transformers, above 1 faster (TTFT: the peer's seconds ÷ ours).
Greedy tokens of both must be equal.

Where a service decode step goes: after the service stops, the same launch is made in this process
(programs HIT in the same cache) and the same decode is timed step by step (after a warm-up: the
first seconds after a launch run slower; the median of REPEATS replays): each program family's
seconds (the routed experts' programs hold the FP4 expert decode; the layer programs the FP8
attention and shared expert), the routed experts run eagerly, grouped by expert (rows the compiled
picked program does not serve; every step op by op), the engine around them (KV writes, row
tensors), sampling; what is left of the service's per-token interval is scheduling, streaming and
HTTP.

Target (issue 37): decode ≥ 1.0× at both concurrencies on `small` with a compiled backend.
Reported, never asserted.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

PROMPT_TOKENS, NEW_TOKENS, CONCURRENT = 32, 64, 8
REPEATS = 3
TTFT_ROUNDS = 8  # first tokens alone per side and concurrency, beside the runs'
TARGET = 1.0  # decode tokens/s, service ÷ transformers, at both concurrencies
SERVICE, PEER = "service", "transformers"
LLAMA_CPP = "llama.cpp"  # the other peer (`bench.llamacpp_peer`)
PEERS = (PEER, LLAMA_CPP)
WHO = "dsv4 bench peer"


@dataclass(frozen=True)
class Run:
    """One side's run of one concurrency: its figures and the greedy tokens of each prompt."""

    ttft_s: float  # time to first token (of several requests: the median)
    decode_s: float  # wall seconds after the first token (of several: first first token to last token)
    decode_tokens: int  # tokens after each sequence's first, summed
    interval_s: float  # seconds per token of one sequence after its first (median over sequences)
    tokens: tuple[tuple[int, ...], ...]

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tokens": [list(t) for t in self.tokens],
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2)}


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    """`count` distinct prompts of `length` tokens (deterministic)."""
    return [[(31 * i + 7 * k + 3) % vocab for k in range(length)] for i in range(count)]


def _median(runs: list[Run], firsts: Sequence[float] = ()) -> Run:
    """The run of median decode tokens/s (of an even count, the slower middle one), with the
    median time to first token of all the runs and the `firsts` measured alone: one first token
    is one step, which a moment's load on a shared machine can double (one prefill of eight 1.4 s
    against 0.7-0.9 s in the runs around it)."""
    middle = sorted(runs, key=lambda r: r.decode_tokens_per_s)[(len(runs) - 1) // 2]
    return replace(middle, ttft_s=statistics.median_low([*(r.ttft_s for r in runs), *firsts]))


def _turns(sides: dict[str, Any], turn: int) -> list[tuple[str, Any]]:
    """The sides in the order they run at `turn`: each goes first every other turn."""
    order = list(sides.items())
    return order if turn % 2 == 0 else order[::-1]


def _stream(client, url: str, prompt: list[int], new_tokens: int) -> tuple[float, float, float, list[int]]:
    """One streamed greedy completion on `client` (an httpx.Client): (sent, first token, last
    token) perf_counter times, ids."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    ids: list[int] = []
    sent = time.perf_counter()
    first = last = sent
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got = [t for choice in json.loads(line[6:])["choices"] for t in choice.get("token_ids") or []]
                if got:
                    last = time.perf_counter()
                    if not ids:
                        first = last
                    ids += got
    return sent, first, last, ids


def service_run(url: str, batch: list[list[int]], new_tokens: int, stream: Callable[..., Any] | None = None) -> Run:
    """Every prompt of `batch` as its own request, all at once, on one client made before the
    clock starts: a client of its own per request spent 20-40 ms each building an SSL context,
    in the time to first token, and eight of them under one GIL spread the "concurrent" requests
    over 50-75 ms. `stream`: how one request streams (default the service's /v1/completions;
    llama-server's /completion: `bench.llamacpp_peer.stream`)."""
    import httpx

    stream = stream or _stream
    with httpx.Client(timeout=3600, limits=httpx.Limits(max_connections=len(batch))) as client, \
            ThreadPoolExecutor(len(batch)) as pool:
        done = list(pool.map(lambda p: stream(client, url, p, new_tokens), batch))
    firsts, lasts = [d[1] for d in done], [d[2] for d in done]
    return Run(ttft_s=statistics.median(d[1] - d[0] for d in done), decode_s=max(lasts) - min(firsts),
               decode_tokens=sum(max(len(d[3]) - 1, 0) for d in done),
               interval_s=statistics.median((d[2] - d[1]) / max(len(d[3]) - 1, 1) for d in done),
               tokens=tuple(tuple(d[3]) for d in done))


def _generate(peer: Any, batch: list[list[int]], new_tokens: int) -> tuple[float, Any]:
    """The batch as one greedy `generate` of `new_tokens`, KV cache on: (seconds, new ids)."""
    import torch

    ids = torch.tensor(batch, dtype=torch.int64)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = peer.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                            use_cache=True)
    return time.perf_counter() - t0, out[:, ids.shape[1]:]


def service_first(url: str, batch: list[list[int]], stream: Callable[..., Any] | None = None) -> float:
    """The service's time to first token alone: every prompt a one-token request, all at once."""
    return service_run(url, batch, 1, stream).ttft_s


def peer_first(peer: Any, batch: list[list[int]]) -> float:
    """The peer's time to first token alone: a `generate` of one token."""
    return _generate(peer, batch, 1)[0]


def peer_run(peer: Any, batch: list[list[int]], new_tokens: int) -> Run:
    """The batch as one greedy `generate`, KV cache on: one new token (the time to first token),
    then all of them; decode is the difference."""
    ttft = peer_first(peer, batch)
    full, out = _generate(peer, batch, new_tokens)
    decode = max(full - ttft, 1e-9)
    return Run(ttft_s=ttft, decode_s=decode, decode_tokens=len(batch) * (new_tokens - 1),
               interval_s=decode / max(new_tokens - 1, 1), tokens=tuple(tuple(r) for r in out.tolist()))


# not a program: the rows the compiled picked program does not serve, grouped by expert eagerly (with
# `experts.native` compiled, the routed experts are that program's, under "experts")
GROUPED = "experts grouped (eager)"


def _family(program: str) -> str:
    return program.split(".")[0]  # layer | experts | embed | head


def time_programs(engine: Any) -> dict[str, float]:
    """Wrap the engine's programs (in place) so each call adds its seconds to its family in the
    returned dict; empty forever when the engine runs the model code without programs."""
    table = getattr(engine.runners, "table", engine.runners)  # program name → runner
    spent: dict[str, float] = {}

    def timed(family: str, run: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                spent[family] = spent.get(family, 0.0) + time.perf_counter() - t0
        return call

    for name in list(table or ()):
        table[name] = timed(_family(name), table[name])
    if getattr(engine.runners, "grouped", None) is not None:  # the routed experts run eagerly, grouped
        engine.runners.grouped = timed(GROUPED, engine.runners.grouped)
    return spent


def step_split(engine: Any, spent: dict[str, float], batch: list[list[int]], new_tokens: int) -> dict[str, float]:
    """The service's greedy decode of `batch` replayed on `engine` (its programs wrapped by
    `time_programs`, which fills `spent`): mean seconds per decode step in each program family,
    the engine around them, and sampling."""
    import torch

    from runtime.engine.sampling import Sampler, Sampling

    slots = range(len(batch))
    samplers = [Sampler(Sampling(new_tokens), p) for p in batch]
    last = []
    for slot, prompt, sampler in zip(slots, batch, samplers, strict=True):
        engine.reset(slot)
        last.append(sampler.sample(engine.forward(torch.tensor(prompt), slot).logits[-1]))
    spent.clear()
    step_s = sample_s = 0.0
    steps = max(new_tokens - 1, 1)
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = engine.step([(s, torch.tensor([t])) for s, t in zip(slots, last, strict=True)]).logits
        t1 = time.perf_counter()
        last = [sampler.sample(logits[i]) for i, sampler in enumerate(samplers)]
        step_s += t1 - t0
        sample_s += time.perf_counter() - t1
    programs = {f if f == GROUPED else f"programs {f}.*": s / steps for f, s in sorted(spent.items())}
    return {**programs, "engine around the programs": step_s / steps - sum(programs.values()),
            "engine step": step_s / steps, "sampling": sample_s / steps}


def measure(preset: str = "tiny", backend: str = "aoti", prompt_tokens: int = PROMPT_TOKENS,
            new_tokens: int = NEW_TOKENS, concurrent: int = CONCURRENT, repeats: int = REPEATS,
            ttft_rounds: int = TTFT_ROUNDS, model: Path | None = None,
            log: Callable[[str], None] = print, peer: str = PEER) -> dict[str, Any]:
    """Both sides on the preset's checkpoint (or `model`), 1 and `concurrent` sequences, each
    `repeats` times and `ttft_rounds` first tokens alone (the sides taking turns); each side's run
    of median decode tokens/s, with its median first token. `peer`: transformers' generate, or
    llama.cpp's server (`bench.llamacpp_peer`)."""
    import torch

    from runtime.model.config import load_config
    from runtime.synth.checkpoint import ensure_default_model

    if peer == PEER:
        from bench.hf_peer import require_transformers

        require_transformers(WHO)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # its notes on the synthetic config's rope fields are not figures
        hf_logging.disable_progress_bar()
    from bench.service_bench import _start
    from runtime.launch.spec import DEFAULTS
    from store.paths import kernel_cache_dir

    model = model or ensure_default_model(preset)[0]
    config = load_config(model)
    threads = torch.get_num_threads()  # the service's too (OMP_NUM_THREADS): one rank keeps torch's default
    loads = sorted({1, concurrent})
    batches = {n: prompts(n, prompt_tokens, config.vocab_size) for n in loads}
    max_seq = max(DEFAULTS.max_seq, prompt_tokens + new_tokens)
    cache = kernel_cache_dir()
    result: dict[str, Any] = {"preset": preset, "backend": backend, "threads": threads, "cpus": os.cpu_count(),
                              "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "max_seq": max_seq,
                              "loads": loads, "repeats": repeats, "ttft_rounds": ttft_rounds, "split_s": {},
                              "peer": peer}
    def per_side() -> dict[str, dict[int, list]]:
        return {side: {n: [] for n in loads} for side in (SERVICE, peer)}

    runs: dict[str, dict[int, list[Run]]] = per_side()
    firsts: dict[str, dict[int, list[float]]] = per_side()  # first tokens measured alone
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-peer-") as tmp, contextlib.ExitStack() as stack:
        if peer == LLAMA_CPP:  # built and converted (once, cached) before either side runs
            from bench import llamacpp_peer as lc

            binary, own = lc.server(log), lc.gguf(model, lc.OWN_TYPES, log)
            log(f"{LLAMA_CPP}: greedy tokens of the float32 conversion (flash attention off) …")
            reference = lc.reference_tokens(model, batches[max(loads)], new_tokens, threads, max_seq, log, Path(tmp))
        run_dir = Path(tmp) / "serve"
        run_dir.mkdir()
        log(f"{SERVICE}: starting dsv4 serve --backend {backend} (programs in {cache}) …")
        proc, url = _start(model, run_dir, backend, cache_dir=cache, max_seq=max_seq, slots=max(loads),
                           env={"OMP_NUM_THREADS": str(threads)})
        try:
            if peer == LLAMA_CPP:
                log(f"{LLAMA_CPP}: {binary.name} of {own.name}, {threads} threads, {max(loads)} slots …")
                server = stack.enter_context(lc.Server(binary, own, threads, max(loads), max_seq,
                                                       Path(tmp) / "llama-server.log"))
                peer_side = functools.partial(service_run, server.url, stream=lc.stream)
                peer_alone = functools.partial(service_first, server.url, stream=lc.stream)
            else:
                from bench.hf_peer import main_model_peer

                log(f"{PEER}: float32 copy of the checkpoint, from_pretrained …")
                torch.set_num_threads(threads)
                hf = main_model_peer(model, Path(tmp) / "peer")
                peer_side, peer_alone = functools.partial(peer_run, hf), functools.partial(peer_first, hf)
            sides = {SERVICE: functools.partial(service_run, url), peer: peer_side}
            first = {SERVICE: functools.partial(service_first, url), peer: peer_alone}
            for n in loads:  # first calls of each shape (allocations, caches) are not the figures
                for run in sides.values():
                    run(batches[n], min(new_tokens, 4))
            for i in range(repeats):  # the sides take turns: a drift of the machine's speed falls on both
                for n in loads:
                    for side, run in _turns(sides, i):
                        log(f"{side}: {n} at once, {new_tokens} tokens (run {i + 1}/{repeats}) …")
                        runs[side][n].append(run(batches[n], new_tokens))
            log(f"first tokens alone, {ttft_rounds} rounds …")
            for i in range(ttft_rounds):
                for n in loads:
                    for side, run in _turns(first, i):
                        firsts[side][n].append(run(batches[n]))
            del sides, first, run, peer_side, peer_alone  # the peer's memory, before the launch below
            stack.close()
        finally:
            proc.terminate()
            proc.wait(timeout=120)
    for side, by_load in runs.items():
        result[side] = {n: _median(rs, firsts[side][n]) for n, rs in by_load.items()}
    if peer == LLAMA_CPP:  # the service's tokens against llama.cpp's float32 ones (its own types round otherwise)
        result["tokens_equal"] = all(r.tokens == reference[:n] for n in loads for r in runs[SERVICE][n])
        result["reference"] = "llama.cpp float32 conversion and KV cache, flash attention off"
        result["reference_tokens"] = [list(t) for t in reference]
    else:
        result["tokens_equal"] = all(r.tokens == result[PEER][n].tokens for side in runs for n in loads
                                     for r in runs[side][n])
    result["split_s"] = service_split(model, cache, backend, max_seq, loads, batches, new_tokens, repeats, log)
    ours, theirs = result[SERVICE], result[peer]
    prefix = "llamacpp_" if peer == LLAMA_CPP else ""
    for n in loads:
        a, b = ours[n], theirs[n]
        result[f"{prefix}decode_ratio_{n}"] = round(a.decode_tokens_per_s / b.decode_tokens_per_s, 3) \
            if b.decode_tokens_per_s else None
        result[f"{prefix}ttft_ratio_{n}"] = round(b.ttft_s / a.ttft_s, 3) if a.ttft_s else None
    result["target"] = TARGET
    return result


def service_split(model: Path, cache: Path, backend: str, max_seq: int, loads: list[int],
                  batches: dict[int, list[list[int]]], new_tokens: int, repeats: int,
                  log: Callable[[str], None]) -> dict[int, dict[str, float]]:
    """Where a service decode step goes: the same launch in this process, the same decode timed
    step by step (the median step's split of `repeats` replays, after a warm-up)."""
    from runtime.events import Emitter
    from runtime.launch.registration import register
    from runtime.launch.spec import LaunchSpec

    log("where a service decode step goes: its launch in this process, the same decode step by step …")
    spec = LaunchSpec(model, kernel_cache_dir=cache, backend=backend, device="cpu", max_seq=max_seq,
                      max_slots=max(loads))
    launched = register(spec, Emitter(lambda _e: None), record=False)
    split = {}
    try:
        spent = time_programs(launched.engine)
        for n in loads:  # warm-up: the first steps after a launch run slower for seconds
            step_split(launched.engine, spent, batches[n], new_tokens)
        for n in loads:
            splits = sorted((step_split(launched.engine, spent, batches[n], new_tokens) for _ in range(repeats)),
                            key=lambda s: s["engine step"])
            split[n] = splits[(len(splits) - 1) // 2]  # the median step's split
    finally:
        launched.close()
    return split


def as_json(r: dict[str, Any]) -> dict[str, Any]:
    """`measure`'s result with stable string keys: decode_ratio_1, decode_ratio_<N>, tokens_equal, …"""
    def side(runs: dict[int, Run]) -> dict[str, Any]:
        return {str(n): run.to_json() for n, run in runs.items()}

    return {**r, SERVICE: side(r[SERVICE]), r["peer"]: side(r[r["peer"]]),
            "split_s": {str(n): {k: round(v, 6) for k, v in s.items()} for n, s in r["split_s"].items()}}


def tables(r: dict[str, Any]) -> list[tuple[str, list[str], list[list]]]:
    """The side-by-side table and the step split, from `measure`'s result."""
    rows, peer = [], r["peer"]
    prefix = "llamacpp_" if peer == LLAMA_CPP else ""
    for n in r["loads"]:
        a, b = r[SERVICE][n], r[peer][n]
        ratio, target = r[f"{prefix}decode_ratio_{n}"], f"≥ {r['target']}×"
        verdict = "" if ratio is None else ("met" if ratio >= r["target"] else "MISSED")
        rows += [[f"decode tokens/s, {n} at once", f"{b.decode_tokens_per_s:.1f}", f"{a.decode_tokens_per_s:.1f}",
                  f"{ratio}×", target, verdict],
                 [f"time to first token (ms), {n} at once", f"{b.ttft_s * 1e3:.1f}", f"{a.ttft_s * 1e3:.1f}",
                  f"{r[f'{prefix}ttft_ratio_{n}']}×", "", ""],
                 [f"per-token interval of a sequence (ms), {n} at once", f"{b.interval_s * 1e3:.2f}",
                  f"{a.interval_s * 1e3:.2f}", "", "", ""]]
    rows.append([f"greedy tokens equal ({r.get('reference', peer)})", "", "", "", "",
                 "yes" if r["tokens_equal"] else "NO"])
    against = ("llama.cpp's llama-server (its own types: MXFP4 experts, Q8_0, BF16)" if peer == LLAMA_CPP
               else "transformers generate (float32, same weights)")
    main = (f"{r['preset']}: dsv4 serve ({r['backend']}) against {against}, "
            f"{r['prompt_tokens']}-token prompts, {r['new_tokens']} greedy tokens, {r['threads']} threads on "
            f"{r['cpus']} CPUs — ratio: service ÷ {peer} (above 1 faster)",
            ["figure", peer, SERVICE, "ratio", "target", ""], rows)
    split_rows = []
    keys = list(dict.fromkeys(k for s in r["split_s"].values() for k in s))
    for k in keys:
        split_rows.append([k, *(f"{r['split_s'][n].get(k, 0.0) * 1e3:.2f}" for n in r["loads"])])
    left = []
    for n in r["loads"]:
        s = r["split_s"][n]
        left.append(f"{(r[SERVICE][n].interval_s - s['engine step'] - s['sampling']) * 1e3:.2f}")
    split_rows += [["service per-token interval", *(f"{r[SERVICE][n].interval_s * 1e3:.2f}" for n in r["loads"])],
                   ["left: scheduling, streaming, HTTP", *left]]
    split = ("a service decode step (ms): its engine replayed in this process, beside the service's interval",
             ["part", *(f"{n} at once" for n in r["loads"])], split_rows)
    return [main, split]


def main(preset: str = "tiny", backend: str = "aoti", json_output: bool = False,
         prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS, peer: str = PEER) -> int:
    import sys

    from bench.report import print_json, print_table

    log = (lambda s: None) if json_output else (lambda s: print(s, file=sys.stderr, flush=True))
    if peer == LLAMA_CPP:
        from bench.llamacpp_peer import PeerUnavailable

        try:
            r = measure(preset, backend, prompt_tokens, new_tokens, log=log, peer=peer)
        except PeerUnavailable as e:  # llama.cpp cannot run this checkpoint here: why, in one line
            print(f"dsv4 bench peer: llama.cpp cannot run {preset} here: {e}", file=sys.stderr)
            return 1
    else:
        r = measure(preset, backend, prompt_tokens, new_tokens, log=log)
    if json_output:
        print_json(as_json(r))
    else:
        for t in tables(r):
            print_table(*t)
        print(f"load average {round(os.getloadavg()[0], 2)} on {r['cpus']} CPUs")
    return 0
