"""`dsv4 bench accelerator`: the whole serving path on one device, in one prepared run.

`bench/accelerator.sh OUT --device cuda` runs it on a bare GPU host (installing carried
wheels first); the test suite runs it on the cpu, so the run cannot rot. For each preset:

  1. synthesise the checkpoint; read the device's memory (NVML, npu-smi or host memory) before
     anything of ours runs;
  2. cold launch: `dsv4 serve --device D` on an empty kernel cache and no sidecar, so every
     program compiles (AOTInductor unless --backend says otherwise) into the cache and the
     weights are packed from the checkpoint;
  3. `dsv4 prepack`, then `dsv4 sidecar warm`: the sidecar hot in the page cache;
  4. (accelerators) the upload path in a child process: the hot sidecar mapped and uploaded
     through one staging buffer and through two, beside a pinned and a pageable
     host-to-device copy of as many bytes;
  5. hot launch (programs HIT, sidecar MAP) with SLOTS slots: the device's memory while it
     serves and after it stopped, `dsv4-console --once --json` beside it (the Device pane
     against the runtime's figures), greedy completions with log-probabilities against the
     cpu eager reference of the same checkpoint, and decode tokens/s under concurrent
     streamed requests (1, 16 and 64 by default).

Every figure goes into OUT/accelerator.json, rewritten after each step: a run cut short keeps
what it measured; checkpoints, kernel caches and service logs go under --work (default
OUT/work). This process never imports torch, so it holds no device memory of its own
while it reads the device's; torch runs in the services and in its own child processes.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.ranks_services import MAX_SEQ, prepack, run_load, serving
from runtime.events import REGISTRATION

FIGURES = "accelerator.json"
LOADS = (1, 16, 64)
SLOTS = 64  # the hot launch's --max-slots: the largest load runs in one batch
GREEDY_TOKENS = 32
# a prompt of special and plain ids, one of repeats, one of the vocabulary's top end (tiny's is 512)
PROMPTS = ([0, 17, 42, 99, 3, 250, 7], [5] * 12, [400, 401, 402, 403, 404, 300, 200, 100])
# |Δ log-probability| of a greedy token, device vs cpu eager: float32 on both, but other kernels
# and reduction orders (the cpu export programs agree with eager to 2e-3 in tests/test_logprobs.py)
TOLERANCE = 2e-2
MESSAGES = 100  # log and error lines kept per launch
MARK = ".dsv4-bench-accelerator"  # in each preset's work directory: only such a directory is replaced


def main(device: str, presets: Sequence[str], out: Path, backend: str = "aoti", loads: Sequence[int] = LOADS,
         greedy_tokens: int = GREEDY_TOKENS, json_output: bool = False, work: Path | None = None) -> int:
    """`out` gets accelerator.json alone (and the script's log.txt); checkpoints, kernel
    caches and service logs go under `work` (default out/work)."""
    from runtime.launch.hardware import resolve_device

    kind = resolve_device(device)
    out.mkdir(parents=True, exist_ok=True)
    say = (lambda *_: None) if json_output else (lambda msg: print(msg, file=sys.stderr, flush=True))
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": machine(kind),
                              "device": kind, "backend": backend, "presets": {}}
    for preset in presets:
        figures: dict[str, Any] = {}
        result["presets"][preset] = figures
        try:
            run_preset(preset, kind, backend, (work or out / "work") / preset, loads, greedy_tokens, figures,
                       lambda: write_json(out / FIGURES, result), say)
        except Exception as e:  # what was measured stays, and the failure is a figure too
            figures["error"] = f"{type(e).__name__}: {e}"[-6000:]
            say(f"{preset}: FAILED: {figures['error']}")
            break  # the next preset would fail the same way, on more bytes
    write_json(out / FIGURES, result)
    print(json.dumps(result, indent=2) if json_output else report(result))
    return 0 if all(f.get("greedy", {}).get("equal_or_within_tolerance") for f in result["presets"].values()) else 1


def run_preset(preset: str, kind: str, backend: str, work: Path, loads: Sequence[int], greedy_tokens: int,
               figures: dict[str, Any], save: Callable[[], None], say: Callable[[str], None]) -> None:
    from runtime.launch.hardware import read_memory

    if work.is_symlink() or (work.exists() and not (work / MARK).is_file()):
        raise RuntimeError(f"{work} exists and is not this bench's own work directory; choose another --work")
    if work.exists():  # the bench's own, from an earlier run: cold means cold
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / MARK).write_text("made by dsv4 bench accelerator: replaced on its next run\n")
    model, cache = work / "model", work / "kernel-cache"
    say(f"{preset}: synthesising")
    figures["synth_s"] = timed(_dsv4, "synth", "--preset", preset, str(model))
    figures["memory_before"] = memory_json(read_memory(kind))
    save()

    say(f"{preset}: cold launch on {kind} (every program compiles with {backend}, weights packed)")
    with serving(model, cache, work / "cold", backend, 1, _serve_options(), device=kind) as service:
        figures["cold"] = launch_figures(service.events, service.started)
    save()

    say(f"{preset}: prepack, then warm the sidecar")
    figures["prepack_s"] = round(prepack(model, 1)[0], 3)
    figures["warm_s"] = timed(_dsv4, "sidecar", "warm", str(model))
    if kind != "cpu":
        say(f"{preset}: upload path: one vs two staging buffers, pinned and pageable copies")
        figures["upload"] = child("upload", kind, str(model))
    save()

    say(f"{preset}: hot launch (programs HIT, sidecar MAP), {SLOTS} slots")
    with serving(model, cache, work / "hot", backend, 1, _serve_options(), device=kind) as service:
        figures["hot"] = launch_figures(service.events, service.started)
        figures["memory_serving"] = memory_json(read_memory(kind))
        figures["console"] = console_figures(model, cache, backend, kind, figures["hot"], read_memory(kind))
        save()
        say(f"{preset}: greedy completions against the cpu eager reference")
        served = [complete(service.url, p, greedy_tokens) for p in PROMPTS]
        reference = child("reference", str(model), str(greedy_tokens))
        figures["greedy"] = compare_greedy(reference, served)
        save()
        run_load(service.url, 1, 1)  # warm-up
        figures["decode"] = {}
        for clients in loads:
            say(f"{preset}: decode, {clients} concurrent")
            figures["decode"][str(clients)] = run_load(service.url, clients, max(4, 2 * clients))
            save()
    figures["memory_after"] = memory_json(read_memory(kind))
    save()


def _serve_options() -> list[str]:
    return ["--max-slots", str(SLOTS)]


def _dsv4(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "console.cli", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"dsv4 {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-2000:]}")


def timed(fn: Callable[..., Any], *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return round(time.perf_counter() - t0, 3)


def child(mode: str, *args: str) -> Any:
    """Run one of this module's torch-side measurements in a fresh process; its JSON answer."""
    r = subprocess.run([sys.executable, "-m", "bench.accelerator_bench", mode, *args], capture_output=True,
                       text=True)
    if r.returncode != 0:
        raise RuntimeError(f"accelerator bench: {mode} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)  # a reader sees the previous figures or these, never half of them


def machine(kind: str) -> dict[str, Any]:
    from runtime.toolchain import torch_build

    info: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                            "torch": torch_build().get("__version__"), "torch_cuda": torch_build().get("cuda")}
    if kind == "cuda" and shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        info["gpus"] = [line.strip() for line in r.stdout.splitlines() if line.strip()]
    return info


def memory_json(reading) -> dict[str, Any]:
    return {"source": reading.source, "error": reading.error,
            "devices": [{"name": m.name, **m.to_json()} for m in reading.devices]}


def launch_figures(events: Path, started: float) -> dict[str, Any]:
    """One launch's events: seconds to ready, each registration phase's seconds and end detail
    (programs counts, weights path, upload bytes, KV sizing, validation), upload GB/s, and what
    it said on the way (log and error lines: on a first GPU run, what did not work)."""
    phases: dict[str, Any] = {}
    ready, said = None, []
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e.get("kind") in ("log", "error") and len(said) < MESSAGES:  # a compile that failed, a fallback
            said.append({"phase": e["phase"], "kind": e["kind"], "message": e.get("message")})
        if e.get("kind") != "end":
            continue
        if e["phase"] == "serve":
            ready = e["ts"] - started
        elif e["phase"] in REGISTRATION:
            phases[e["phase"]] = {"seconds": e.get("seconds"), **(e.get("detail") or {})}
    phases.get("check", {}).pop("plan", None)  # the whole plan: large, and the console's figures hold it
    upload = phases.get("upload", {})
    seconds, nbytes = upload.get("seconds"), upload.get("bytes")
    gbps = None if upload.get("zero_copy") or not seconds or not nbytes else round(nbytes / seconds / 1e9, 3)
    return {"ready_s": ready, "phases": phases, "upload_gb_per_s": gbps, "messages": said,
            "programs": phases.get("programs", {}).get("counts"), "weights": phases.get("weights", {}).get("path")}


def console_figures(model: Path, cache: Path, backend: str, kind: str, hot: dict[str, Any], reading) -> dict[str, Any]:
    """`dsv4-console --once --json` with the hot launch's own settings, beside the service: its
    Device pane's reading and KV rule against the runtime's (the kv phase) and the bench's own
    reading taken at the same moment."""
    from runtime.launch.spec import CONSOLE, LaunchSpec

    spec = LaunchSpec(model, kernel_cache_dir=cache, backend=backend, device=kind, max_seq=MAX_SEQ, max_slots=SLOTS)
    r = subprocess.run([sys.executable, "-m", "console.tui.app", *spec.argv(CONSOLE), "--once", "--json"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"dsv4-console --once --json failed ({r.returncode}):\n{r.stderr[-2000:]}")
    pane = json.loads(r.stdout)["device"]
    kv = hot["phases"].get("kv", {})
    shown = pane["devices"][0] if pane.get("devices") else {}
    now = reading.devices[0].to_json() if reading.devices else {}
    return {"pane": {k: pane.get(k) for k in ("kind", "source", "error", "warning", "slot_bytes", "fits",
                                              "slots", "max_slots")}, "pane_device": shown,
            "runtime_kv": {k: kv.get(k) for k in ("total_bytes", "used_bytes", "budget_bytes", "slot_bytes",
                                                  "fits", "slots")},
            "bench_reading": now,
            "total_equal": shown.get("total") == kv.get("total_bytes"),
            "slot_bytes_equal": pane.get("slot_bytes") == kv.get("slot_bytes"),
            "used_vs_bench_reading_mib": (round((shown["used"] - now["used"]) / 2**20, 1)
                                          if shown and now else None)}


def complete(url: str, prompt: list[int], tokens: int) -> dict[str, Any]:
    import httpx

    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": choice["logprobs"]["token_logprobs"]}


def compare_greedy(reference: list[dict[str, Any]], served: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy tokens of the device against the cpu eager reference, prompt by prompt: equal, or
    the first divergent position (with the reference's top-2 gap there: a near-tie is floats,
    a wide gap a bug); the largest |Δ log-probability| over the tokens both chose."""
    per_prompt, worst = [], 0.0
    for i, (ref, got) in enumerate(zip(reference, served, strict=True)):
        first = next((p for p, (a, b) in enumerate(zip(ref["tokens"], got["tokens"], strict=False)) if a != b),
                     None if len(ref["tokens"]) == len(got["tokens"]) else min(len(ref["tokens"]), len(got["tokens"])))
        common = len(ref["tokens"]) if first is None else first
        diff = max((abs(a - b) for a, b in zip(ref["logprobs"][:common], got["logprobs"][:common], strict=True)),
                   default=0.0)
        worst = max(worst, diff)
        row: dict[str, Any] = {"prompt": i, "tokens": len(got["tokens"]), "equal": first is None,
                               "max_abs_logprob_diff": diff}
        if first is not None and first < min(len(ref["tokens"]), len(got["tokens"])):
            row.update(first_divergent_position=first, reference_token=ref["tokens"][first],
                       device_token=got["tokens"][first], reference_top2_gap=ref["gaps"][first])
        per_prompt.append(row)
    equal = all(r["equal"] for r in per_prompt)
    near_ties = all(r["equal"] or r.get("reference_top2_gap", 1.0) <= TOLERANCE for r in per_prompt)
    return {"equal": equal, "max_abs_logprob_diff": worst, "tolerance": TOLERANCE,
            "equal_or_within_tolerance": worst <= TOLERANCE and (equal or near_ties), "prompts": per_prompt}


# ---- the torch side: child processes ---------------------------------------------------------


def reference(model: str, tokens: int) -> list[dict[str, Any]]:
    """Greedy tokens of each prompt on the cpu eager path (no compiled program, no sidecar):
    each token's log-probability and the gap to the runner-up."""
    import torch

    from runtime.events import Emitter
    from runtime.launch.registration import register
    from runtime.launch.spec import LaunchSpec

    spec = LaunchSpec(Path(model), backend="eager", device="cpu", use_sidecar=False, max_seq=MAX_SEQ, max_slots=1,
                      speculative="off")
    launched = register(spec, Emitter(lambda e: None), record=False)
    engine, out = launched.engine, []
    with torch.no_grad():
        for prompt in PROMPTS:
            engine.reset(0)
            step, row = engine.forward(torch.tensor(prompt), 0), {"tokens": [], "logprobs": [], "gaps": []}
            for n in range(tokens):
                top = torch.log_softmax(step.logits[-1].float(), -1).topk(2)
                token = int(top.indices[0])
                row["tokens"].append(token)
                row["logprobs"].append(float(top.values[0]))
                row["gaps"].append(float(top.values[0] - top.values[1]))
                if n + 1 < tokens:
                    step = engine.forward(torch.tensor([token]), 0)
            out.append(row)
    launched.close()
    return out


def upload(kind: str, model: str) -> dict[str, Any]:
    """The hot sidecar mapped and uploaded through one staging buffer, then two (twice each, the
    best kept), beside a pinned and a pageable copy of as many bytes: GB/s of each."""
    import torch

    from runtime.launch.device import get_device
    from store.sidecar.loader import open_sidecar
    from store.sidecar.name import default_sidecar_path

    device = get_device(kind)
    verdict, mapped = open_sidecar(default_sidecar_path(Path(model), 1))
    if mapped is None:
        raise RuntimeError(f"the sidecar did not map: {verdict.line()}")
    nbytes = sum(t.nbytes for t in mapped.tensors.values())
    rates: dict[str, float] = {}

    def rate(name: str, run: Callable[[], Any]) -> None:
        device.synchronize()
        t0 = time.perf_counter()
        kept = run()
        device.synchronize()
        rates[name] = max(rates.get(name, 0.0), round(nbytes / (time.perf_counter() - t0) / 1e9, 3))
        del kept
        device.release()

    for buffers in (1, 2, 1, 2):
        device.staging_buffers = buffers
        rate(f"sidecar_upload_{buffers}_buffers", lambda: device.upload(mapped.tensors))
    mapped.close()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device.torch_device)
    for _ in range(2):
        rate("pinned_copy", lambda: dst.copy_(pinned, non_blocking=True))
        rate("pageable_copy", lambda: dst.copy_(pageable))
    return {"bytes": nbytes, "gb_per_s": rates,
            "two_vs_one_buffer": round(rates["sidecar_upload_2_buffers"] / rates["sidecar_upload_1_buffers"], 3),
            "sidecar_vs_pinned": round(rates["sidecar_upload_2_buffers"] / rates["pinned_copy"], 3)}


# ---- the report -------------------------------------------------------------------------------


def report(result: dict[str, Any]) -> str:
    lines = [f"dsv4 bench accelerator — {result['device']}, backend {result['backend']}, {result['date']}",
             f"machine: {json.dumps(result['machine'])}"]
    for preset, f in result["presets"].items():
        lines.append(f"\n== {preset} ==")
        if "error" in f:
            lines.append(f"FAILED: {f['error'].splitlines()[0]}")
        for name in ("cold", "hot"):
            launch = f.get(name)
            if launch:
                phases = " ".join(f"{p} {launch['phases'][p]['seconds']:.2f}" for p in REGISTRATION
                                  if p in launch["phases"])
                lines.append(f"{name}: ready {launch['ready_s']:.2f} s · {phases} · programs "
                             f"{ {k: v for k, v in (launch['programs'] or {}).items() if v} } · weights "
                             f"{launch['weights']} · upload {launch['upload_gb_per_s'] or 'zero-copy'} GB/s")
        if "upload" in f:
            u = f["upload"]
            lines.append(f"upload of {u['bytes'] / 2**30:.2f} GiB (GB/s): " + ", ".join(
                f"{k} {v}" for k, v in u["gb_per_s"].items()) + f"; two vs one buffer {u['two_vs_one_buffer']}×, "
                f"sidecar vs pinned copy {u['sidecar_vs_pinned']}×")
        for name in ("memory_before", "memory_serving", "memory_after"):
            for d in f.get(name, {}).get("devices", []):
                lines.append(f"{name}: {d['name']}: used {d['used'] / 2**30:.2f} of {d['total'] / 2**30:.2f} GiB")
        kv = f.get("hot", {}).get("phases", {}).get("kv")
        if kv:
            lines.append(f"KV: budget {kv['budget_bytes'] / 2**30:.2f} GiB · slot {kv['slot_bytes'] / 2**20:.2f} MiB · "
                         f"fits {kv['fits']} · took {kv['slots']} (--max-slots {SLOTS})")
        if "console" in f:
            c = f["console"]
            lines.append(f"console Device pane: total equal {c['total_equal']}, slot bytes equal "
                         f"{c['slot_bytes_equal']}, used vs the bench's reading {c['used_vs_bench_reading_mib']} MiB")
        if "greedy" in f:
            g = f["greedy"]
            lines.append(f"greedy vs cpu eager: equal {g['equal']}, max |Δ logprob| {g['max_abs_logprob_diff']:.2e} "
                         f"(tolerance {g['tolerance']})" + "".join(
                             f"; prompt {p['prompt']} diverges at {p['first_divergent_position']} (reference top-2 gap "
                             f"{p['reference_top2_gap']:.2e})"
                             for p in g["prompts"] if "first_divergent_position" in p))
        for clients, d in f.get("decode", {}).items():
            lines.append(f"decode, {clients} concurrent: {d['tokens_per_s']} tok/s (mean batch {d['mean_batch']})")
    return "\n".join(lines)


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    answer = reference(rest[0], int(rest[1])) if mode == "reference" else upload(*rest)
    print(json.dumps(answer))
