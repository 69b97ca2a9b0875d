"""`dsv4 bench hosts`: one service over two hosts that each have their own disks, against one node.

On the test bed of `bench.ns_hosts` (as root): each host a mount + UTS namespace with its own
hostname, its own copy of the checkpoint (other mtimes), kernel cache, state dir and signing key,
every host trusting the other's key; one torchrun agent per host on loopback. The same two ranks
either way:

  one node — one host, `torchrun --nnodes 1 --nproc-per-node 2`;
  2 hosts  — two hosts, `torchrun --nnodes 2 --nproc-per-node 1` each.

Each cold (every kernel cache empty), then hot (every program in every host's cache), weights
packed from the checkpoint every time (`--no-sidecar`: the programs are what differs). Per
launch: seconds from the agents' start to rank 0's `serve` `end` event; per host, the programs
it compiled, the entries it shipped, what it received (entries, bytes) and the seconds it spent
verifying and installing them, and when its programs phase ran (the hosts share this machine's
cores, so "at once" shows in those windows, not in the wall time); rank 0's greedy validation
tokens against one rank alone (eager).

Targets (issue 35): cold ready over 2 hosts ≤ 1.3 × one node's, no program compiled on two hosts,
every launch's tokens equal to one rank's.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ns_hosts import Host, free_port, hosts, namespaces_work, stop, trust_each_other

RANKS = 2
MAX_SEQ = 64
COLD_TARGET = 1.3  # cold ready over 2 hosts / one node's
START_TIMEOUT_S = 3600.0


def _events(path: Path) -> list:
    from runtime.events import parse

    return [parse(line) for line in path.read_text().splitlines()] if path.exists() else []


def launch(bed: list[tuple[Host, int]], out: Path, backend: str) -> dict[str, Any]:
    """One service over `bed` ((host, its rank count) per torchrun node) until rank 0 serves,
    then stopped: its ready seconds and each host's figures."""
    from runtime.programs.outcome import Outcome

    out.mkdir(parents=True)
    port, http = free_port(), free_port()
    started = time.time()
    procs = [h.node(k, len(bed), n, port, out, "--no-sidecar", *(("--port", str(http)) if k == 0 else ()),
                    backend=backend, max_seq=MAX_SEQ) for k, (h, n) in enumerate(bed)]
    lead = out / f"events-{bed[0][0].label}.jsonl"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (ready := [e for e in _events(lead) if e.phase == "serve" and e.kind == "end"]):
            for (h, _), p in zip(bed, procs, strict=True):
                if p.poll() is not None:
                    raise RuntimeError(f"{h.label}'s node exited {p.returncode} before serving:\n"
                                       f"{(out / f'stderr-{h.label}.log').read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not serving within {START_TIMEOUT_S:g} s (logs in {out})")
            time.sleep(0.2)
    finally:
        stop(procs)
    result: dict[str, Any] = {"ready_s": round(ready[0].ts - started, 3), "hosts": {}}
    for h, n in bed:
        events = _events(out / f"events-{h.label}.jsonl")
        ends = {e.rank: e for e in events if e.phase == "programs" and e.kind == "end"}
        starts = {e.rank: e for e in events if e.phase == "programs" and e.kind == "start"}
        compiled: set[str] = set()
        for e in ends.values():
            compiled |= set(e.detail.get("compiled_here") or ())
            compiled |= {p for p, o in (e.detail.get("programs") or {}).items()
                         if o in Outcome.__members__ and Outcome(o).compiles}
        leader = min(ends) if ends else None
        lead_detail = ends[leader].detail if leader is not None else {}
        window = ((round(starts[leader].ts - started, 2), round(ends[leader].ts - started, 2))
                  if leader in starts else None)
        result["hosts"][h.label] = {
            "ranks": n, "compiled": sorted(compiled), "shipped": lead_detail.get("shipped", 0),
            "received": lead_detail.get("received", 0), "received_bytes": lead_detail.get("received_bytes", 0),
            "verify_s": lead_detail.get("verify_s", 0.0), "programs_window_s": window,
            "compile_wall_s": lead_detail.get("compile_wall_s")}
        sharing = lead_detail.get("sharing") or {}
        result.setdefault("mode", sharing.get("mode", ""))
        result.setdefault("why", sharing.get("why", ""))
        if tokens := [e.detail.get("tokens") for e in events if e.phase == "validate" and e.kind == "end"
                      and e.rank == 0]:
            result["tokens"] = tokens[0]
    every = [p for h in result["hosts"].values() for p in h["compiled"]]
    result["compiled"] = len(every)
    result["compiled_twice"] = sorted({p for p in every if every.count(p) > 1})
    return result


def one_rank_tokens(model: Path, work: Path) -> list[int]:
    """Greedy validation tokens of one rank alone (eager), in this process, in dirs of its own."""
    from runtime.events import Emitter
    from runtime.launch.registration import register
    from runtime.launch.spec import LaunchSpec

    saved = {k: os.environ.get(k) for k in ("DSV4_STATE_DIR", "DSV4_DATA_DIR", "DSV4_KERNEL_CACHE_DIR")}
    os.environ.update({k: str(work / k.lower()) for k in saved})
    try:
        spec = LaunchSpec(model, backend="eager", device="cpu", max_seq=MAX_SEQ, use_sidecar=False)
        launched = register(spec, Emitter(), record=False)
        tokens = list(launched.validation_tokens)
        launched.close()
        return tokens
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure(preset: str, backend: str, log=print) -> dict[str, Any]:
    from runtime.synth.checkpoint import synthesize

    with tempfile.TemporaryDirectory(prefix="dsv4-bench-hosts-") as tmp:
        tmp = Path(tmp)
        log(f"synthesizing the {preset} checkpoint …")
        model = synthesize(preset, tmp / "model")
        two = hosts(tmp / "two", model, ["host-a", "host-b"])
        trust_each_other(two)
        [node] = hosts(tmp / "one", model, ["node"])
        trust_each_other([node])  # the same keys setting as the hosts (one host: nothing to ship)
        one_bed, two_bed = [(node, RANKS)], [(h, RANKS // len(two)) for h in two]
        runs: dict[str, dict[str, Any]] = {}
        for temperature in ("cold", "hot"):
            for name, bed in (("one node", one_bed), ("2 hosts", two_bed)):
                log(f"{temperature}: {name} …")
                runs[f"{temperature} {name}"] = launch(bed, tmp / "runs" / f"{temperature}-{name.replace(' ', '-')}",
                                                       backend)
        log("one rank alone (eager) …")
        reference = one_rank_tokens(model, tmp / "one-rank")
    cold_ratio = runs["cold 2 hosts"]["ready_s"] / runs["cold one node"]["ready_s"]
    hot_ratio = runs["hot 2 hosts"]["ready_s"] / runs["hot one node"]["ready_s"]
    targets = {"cold_ratio": round(cold_ratio, 3), "cold_ratio_met": cold_ratio <= COLD_TARGET,
               "hot_ratio": round(hot_ratio, 3),
               "compiled_once": not runs["cold 2 hosts"]["compiled_twice"],
               "tokens_equal": all(r.get("tokens") == reference for r in runs.values())}
    return {"preset": preset, "backend": backend, "ranks": RANKS, "target_cold_ratio": COLD_TARGET,
            "runs": runs, "one_rank_tokens": reference, "targets": targets}


def main(preset: str = "tiny", backend: str = "export", json_output: bool = False) -> int:
    from bench.report import print_json

    if why := namespaces_work():
        print(f"dsv4 bench hosts: needs mount + UTS namespaces (as root): {why}", file=sys.stderr)
        return 1
    result = measure(preset, backend, log=(lambda s: None) if json_output else
                     (lambda s: print(s, file=sys.stderr, flush=True)))
    if json_output:
        print_json(result)
    else:
        _print(result)
    return 0


def _print(result: dict[str, Any]) -> None:
    from bench.report import print_table
    from store.units import format_size

    runs, t = result["runs"], result["targets"]
    rows = []
    for name, run in runs.items():
        base = runs[f"{name.split(' ', 1)[0]} one node"]["ready_s"]
        ratio = run["ready_s"] / base if base else 0.0
        target = f"≤ {COLD_TARGET:g}× {'met' if t['cold_ratio_met'] else 'MISSED'}" if name == "cold 2 hosts" else ""
        for i, (host, v) in enumerate(run["hosts"].items()):
            w = v["programs_window_s"]
            rows.append([name if i == 0 else "", f"{run['ready_s']:.1f}" if i == 0 else "",
                         f"{ratio:.2f}×" if i == 0 else "", target if i == 0 else "", host, len(v["compiled"]),
                         v["shipped"], f"{v['received']} ({format_size(v['received_bytes'])})",
                         f"{v['verify_s']:.2f}", f"{w[0]:.1f}–{w[1]:.1f}" if w else "-"])
    print_table(f"one service of {result['ranks']} ranks: 2 namespaced hosts (own disks, trusted keys) vs one node, "
                f"{result['preset']} / {result['backend']}; ratio against one node at the same temperature",
                ["launch", "ready s", "ratio", "target", "host", "compiled", "shipped", "received", "verify s",
                 "programs phase (s)"], rows)
    reference = result["one_rank_tokens"]
    print_table("greedy validation tokens against one rank alone (eager); target: equal",
                ["launch", "tokens", "equal"],
                [["one rank", " ".join(map(str, reference)), ""],
                 *([name, " ".join(map(str, run.get("tokens") or [])), "yes" if run.get("tokens") == reference
                    else "NO"] for name, run in runs.items())])
    cold = runs["cold 2 hosts"]
    twice = ", ".join(cold["compiled_twice"]) or "none"
    print(f"2 hosts, cold: {cold.get('mode')} ({cold.get('why')}); compiled twice: {twice} (target none: "
          f"{'met' if t['compiled_once'] else 'MISSED'}); tokens equal: {'met' if t['tokens_equal'] else 'MISSED'}; "
          "programs phase: seconds from the agents' start (the hosts share this machine's cores)")
