"""One compile in its own process: `python -m runtime.programs.worker` reads a job (JSON) on stdin,
compiles the program through the kernel cache's normal path (lock, staging, one rename), and
prints one JSON line: outcome, seconds and this process's peak RSS.

A process per compile is what makes a pool of them cancellable (a killed worker leaves only a
staging dir its successor sweeps) and measurable (its peak RSS is the compile's).
"""

from __future__ import annotations

import json
import resource
import sys
import time
import warnings
from typing import Any

from runtime.programs.spec import DynamicDim, ProgramSpec, TensorSpec


def spec_to_json(spec: ProgramSpec) -> dict[str, Any]:
    if not isinstance(spec.fn, str):
        raise TypeError(f"{spec.name}: only a spec that names its function (module:qualname) compiles in a worker")
    return {"name": spec.name, "fn": spec.fn, "captures": spec.captures,
            "inputs": [[t.name, t.dtype, list(t.shape)] for t in spec.inputs],
            "dims": [[d.name, d.min, d.max] for d in spec.dims],
            "layout": dict(spec.layout), "model_dims": dict(spec.model_dims)}


def spec_from_json(data: dict[str, Any]) -> ProgramSpec:
    return ProgramSpec(data["name"], data["fn"], tuple(TensorSpec(n, d, tuple(s)) for n, d, s in data["inputs"]),
                       tuple(DynamicDim(*d) for d in data["dims"]), data["layout"], data["model_dims"],
                       data["captures"])


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main() -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's, once per compile otherwise
    job = json.loads(sys.stdin.read())
    from runtime.torch_import import import_torch

    import_torch()  # before runtime.programs.build imports it: inductor's compile then walks less
    from runtime.programs.build import prepare
    from store.kernel_cache import KernelCache

    started = time.perf_counter()
    spec = spec_from_json(job["spec"])
    try:
        prepared = prepare(spec, cache=KernelCache(job["cache_root"]), backend=job["backend"],
                           device=job["device"], load=False)
        result = {"program": spec.name, "ok": True, "outcome": prepared.outcome, "reason": prepared.reason,
                  "miss_kind": prepared.miss_kind, "fingerprint": prepared.fingerprint}
    except Exception as e:  # reported to the parent, which keeps the program eager or fails the launch
        result = {"program": spec.name, "ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    result.update(seconds=round(time.perf_counter() - started, 3), peak_rss=peak_rss_bytes())
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
