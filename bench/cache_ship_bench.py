"""`dsv4 bench cache-ship`: how a host gets a launch's compiled programs — compile them cold, pull
them from a registry, or import a bundle — each followed by a launch that HITs every program.

Everything runs as operators run it (`dsv4 compile`, `cache push|pull|export|import` in their
own processes, a real `docker-registry` on 127.0.0.1 with filesystem storage); the launches are
in-process registrations. Target: pull + verify at most 5 % of the cold compile's seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PULL_TARGET = 0.05  # pull + verify seconds / cold compile seconds
MAX_SEQ = 256  # small fixed KV caches: the launches measure programs, not KV allocation


def _dsv4(*args: Any, env: dict[str, str]) -> float:
    """Seconds `dsv4 ARGS` took; RuntimeError with its stderr when it fails."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "console.cli", *map(str, args)], capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        raise RuntimeError(f"dsv4 {' '.join(map(str, args[:3]))} failed: {done.stderr.strip()[-800:]}")
    return time.perf_counter() - started


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _launch(model: Path, cache: Path, backend: str) -> dict[str, Any]:
    """One in-process launch; its seconds and whether every program HIT."""
    from runtime.events import Emitter
    from runtime.launch.registration import register
    from runtime.launch.spec import LaunchSpec

    events: list = []
    spec = LaunchSpec(model, kernel_cache_dir=cache, backend=backend, device="cpu", max_seq=MAX_SEQ,
                      use_sidecar=False)
    started = time.perf_counter()
    launched = register(spec, Emitter(events.append), record=False)
    seconds = time.perf_counter() - started
    launched.close()
    ends = [e.detail for e in events if e.phase == "programs" and e.kind == "end"]
    programs = {k: str(v) for k, v in (ends[-1].get("programs") or {}).items()} if ends else {}
    return {"launch_s": seconds, "all_hit": bool(programs) and set(programs.values()) == {"HIT"},
            "programs": len(programs), "outcomes": sorted(set(programs.values()))}


def measure(preset: str, backend: str, log=print) -> dict[str, Any]:
    from runtime.synth.checkpoint import synthesize

    binary = shutil.which("docker-registry")
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-ship-") as tmp:
        tmp = Path(tmp)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor"), "DSV4_STATE_DIR": str(tmp / "state"),
               "DSV4_SIGNING_KEY": str(tmp / "keys" / "bench.key")}
        launch = ("--backend", backend, "--device", "cpu", "--max-seq", MAX_SEQ)
        log(f"synthesizing the {preset} checkpoint …")
        model = synthesize(preset, tmp / "model")
        _dsv4("keys", "generate", "--name", "bench", env=env)
        env["DSV4_TRUSTED_KEYS"] = str(tmp / "keys" / "bench.key.pub")
        rows: dict[str, dict[str, Any]] = {}

        log(f"cold: compiling every program ({backend}) …")
        cold = tmp / "cold"
        seconds = _dsv4("compile", model, *launch, "--kernel-cache-dir", cold, env=env)
        rows["cold compile"] = {"seconds": seconds, "bytes": _tree_bytes(cold / "v1"), **_launch(model, cold, backend)}

        bundle = tmp / "programs.tar"
        export_s = _dsv4("cache", "export", "-o", bundle, "--model", model, *launch, "--kernel-cache-dir", cold,
                         env=env)
        log("import of a bundle …")
        imported = tmp / "imported"
        seconds = _dsv4("cache", "import", bundle, "--model", model, *launch, "--kernel-cache-dir", imported, env=env)
        rows["import bundle"] = {"seconds": seconds, "bytes": bundle.stat().st_size, "export_s": export_s,
                                 **_launch(model, imported, backend)}

        if binary is None:
            log("docker-registry is not installed (Debian package docker-registry): no registry row")
        else:
            from bench.registry_server import serve

            with serve(binary, tmp / "registry") as reg:
                target = f"{reg.address}/dsv4/programs"
                push_s = _dsv4("cache", "push", target, "--model", model, *launch, "--kernel-cache-dir", cold,
                               "--insecure", env=env)
                log("pull from the local registry …")
                pulled = tmp / "pulled"
                seconds = _dsv4("cache", "pull", target, "--model", model, *launch, "--kernel-cache-dir", pulled,
                                "--insecure", env=env)
                rows["pull registry"] = {"seconds": seconds, "bytes": _tree_bytes(reg.storage), "push_s": push_s,
                                         **_launch(model, pulled, backend)}
    return {"preset": preset, "backend": backend, "rows": rows}


def main(preset: str = "small", backend: str = "aoti", json_output: bool = False) -> int:
    from bench.report import print_json, print_table

    r = measure(preset, backend, log=(lambda s: None) if json_output else print)
    rows = r["rows"]
    cold = rows["cold compile"]["seconds"]
    pull = rows.get("pull registry", {}).get("seconds")
    r["pull_over_compile"] = pull / cold if pull is not None and cold else None
    r["target_met"] = r["pull_over_compile"] is not None and r["pull_over_compile"] <= PULL_TARGET
    if json_output:
        print_json(r)
        return 0
    mib = 2**20
    table = []
    for name, row in rows.items():
        ratio = row["seconds"] / cold if cold else 0.0
        target = f"≤ {PULL_TARGET:.0%}" if name == "pull registry" else ""
        verdict = ("met" if ratio <= PULL_TARGET else "MISSED") if target else ""
        table.append([name, f"{row['seconds']:.2f}", f"{row['bytes'] / mib:,.1f}", f"{ratio:.1%}", target, verdict,
                      f"{row['launch_s']:.2f}", "yes" if row["all_hit"] else "NO"])
    print_table(f"getting a launch's programs, {r['preset']} / {r['backend']} — ratio: seconds against the cold "
                "compile", ["way", "seconds", "MiB", "ratio", "target", "", "launch after (s)", "all HIT"], table)
    extra = {k: v for name in rows for k, v in rows[name].items() if k in ("export_s", "push_s")}
    print(json.dumps({k: round(v, 2) for k, v in extra.items()}))
    return 0
