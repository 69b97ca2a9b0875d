"""Concurrent processes against one kernel cache root and one sidecar (test_rel_concurrency).

usage: concworker.py launch WORKDIR N OUT_JSON   N processes: prepare 3 sample programs
                                                  (export) + an eager launch mapping the sidecar
       concworker.py purge  WORKDIR N OUT_JSON   N-1 readers looking up while 1 purger removes
                                                  and republishes the entries

Children are forked from one parent (torch imported once) and released together through a
pipe, so they really start at once.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

PROGRAMS = ("conc_a", "conc_b", "conc_c")


def fork_all(fns) -> list[int]:
    """Fork one child per fn; all block on one pipe until every child exists, then start."""
    r, w = os.pipe()
    pids = []
    for fn in fns:
        pid = os.fork()
        if pid == 0:
            os.close(w)
            os.read(r, 1)  # EOF once the parent closes its write end
            code = 0
            try:
                fn()
            except BaseException:
                traceback.print_exc()
                code = 3
            os._exit(code)
        pids.append(pid)
    os.close(r)
    os.close(w)  # go
    return pids


def wait_all(pids) -> list[int]:
    return [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]


def launch_mode(work: Path, n: int) -> dict:
    import torch

    torch.set_num_threads(1)
    import sample_programs

    from runtime.events import Emitter
    from runtime.launch.registration import register
    from runtime.launch.spec import LaunchSpec
    from runtime.programs.build import prepare
    from runtime.weights.prepack import prepack
    from store import pagecache
    from store.kernel_cache import KernelCache
    from store.kernel_cache.inventory import inventory

    ckpt, root = work / "ckpt", work / "programs"
    prepack(ckpt, force=True)
    sidecar_path = ckpt / "dsv4-packed.r1.safetensors"
    pagecache.warm(sidecar_path, remember=False)
    before = sidecar_path.read_bytes()
    # warm-up in the parent (a private cache): children inherit initialised export machinery
    prepare(sample_programs.spec("warmup"), cache=KernelCache(work / "warmup"), backend="export")
    spec = LaunchSpec(ckpt, backend="eager", device="cpu", max_seq=64, validate_tokens=4)
    ref = register(spec, Emitter(), record=False)
    ref_tokens = ref.validation_tokens
    ref.close()
    outs = [work / f"out{i}.json" for i in range(n)]

    def child(out: Path) -> None:
        result = {"programs": {}}
        for name in PROGRAMS:
            prepared = prepare(sample_programs.spec(name), cache=KernelCache(root), backend="export")
            x = sample_programs.inputs(seed=len(name))
            result["programs"][name] = {
                "outcome": prepared.outcome,
                "correct": bool(torch.allclose(prepared.run(*x), sample_programs.scaled_mlp(*x))),
            }
        launched = register(spec, Emitter(), record=False)
        result["weights"] = launched.phases["weights"]["path"]
        result["tokens_ok"] = launched.validation_tokens == ref_tokens
        launched.close()
        out.write_text(json.dumps(result))

    codes = wait_all(fork_all([lambda o=o: child(o) for o in outs]))
    results = [json.loads(o.read_text()) if o.exists() else None for o in outs]
    cache = KernelCache(root)
    return {
        "codes": codes,
        "results": results,
        "compiled": {p: sum(1 for r in results if r and r["programs"][p]["outcome"] == "compiled")
                     for p in PROGRAMS},
        "states": sorted(e.state for e in inventory(cache.layout)),
        "verified": cache.verify().checked,
        "quarantined": len(cache.verify().quarantined),
        "sidecar_unchanged": sidecar_path.read_bytes() == before,
    }  # fmt: skip


def purge_mode(work: Path, n: int) -> dict:
    from store.fingerprint import Key
    from store.kernel_cache import QUARANTINE, Hit, KernelCache
    from store.kernel_cache.inventory import inventory, remove

    root = work / "programs"
    cache = KernelCache(root)
    keys = [Key.of({"backend": "export", "source:p": str(i), "torch": "2.13.0"}) for i in range(4)]
    generations = 60

    def payload(i: int, g: int) -> bytes:
        # each rebuild produces other bytes (compilers are not bit-reproducible)
        return f"program {i} generation {g} ".encode() * 2048

    for i, k in enumerate(keys):
        cache.publish("prog", k, {"program.pt2": payload(i, 0)})
    outs = [work / f"reader{i}.json" for i in range(n - 1)]

    def reader(out: Path) -> None:
        c = KernelCache(root)
        counts = {"hit": 0, "miss_absent": 0, "miss_other": [], "wrong_bytes": 0, "errors": []}
        valid = {i: {payload(i, g) for g in range(generations + 1)} for i in range(len(keys))}
        for step in range(400):
            i = step % len(keys)
            try:
                got = c.lookup("prog", keys[i])
            except Exception as e:
                counts["errors"].append(f"{type(e).__name__}: {e}")
                continue
            if isinstance(got, Hit):
                counts["hit"] += 1
                counts["wrong_bytes"] += got.data("program.pt2") not in valid[i]
            elif got.kind == "absent":
                counts["miss_absent"] += 1
            else:
                counts["miss_other"].append(f"{got.kind}: {got.reason}")
        out.write_text(json.dumps(counts))

    def purger() -> None:
        c = KernelCache(root)
        for g in range(1, generations + 1):
            remove(c.layout, inventory(c.layout))
            for i, k in enumerate(keys):
                c.publish("prog", k, {"program.pt2": payload(i, g)})
            time.sleep(0.002)

    codes = wait_all(fork_all([lambda o=o: reader(o) for o in outs] + [purger]))
    results = [json.loads(o.read_text()) if o.exists() else None for o in outs]
    quarantined = sorted(p.name for p in (root / QUARANTINE).iterdir()) if (root / QUARANTINE).exists() else []
    return {"codes": codes, "readers": results, "quarantined": quarantined,
            "final_states": sorted(e.state for e in inventory(cache.layout))}  # fmt: skip


if __name__ == "__main__":
    mode, work, n, out = sys.argv[1:5]
    fn = {"launch": launch_mode, "purge": purge_mode}[mode]
    Path(out).write_text(json.dumps(fn(Path(work), int(n)), indent=1))
