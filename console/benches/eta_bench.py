"""`dsv4 bench eta`: how right the console's compile ETA is, half-way through a real compile.

A tiny checkpoint's programs are compiled twice by `dsv4 compile --events -` with a pool of
`--jobs` workers: once into a first cache (that records each program's compile seconds, what a
later plan expects of it), then into an empty second one. The second run's events, with the
first run's seconds as each program's expectation, are fed to the console's own tracker
(`console.data.launch_state.ProgramStates`) as they were stamped; at the event that takes the
run past half its programs, the ETA it says is set against the seconds the run really had
left. The baseline in the same run is the ETA before this change: the expected seconds of what
is left, summed as if one worker compiled them all. Target: within 25 %.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

TARGET = 0.25


def _compile(model: Path, cache: Path, backend: str, jobs: int) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "console.cli", "compile", str(model), "--kernel-cache-dir",
                          str(cache), "--backend", backend, "--device", "cpu", "--jobs", str(jobs), "--events", "-"],
                         capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def _half_way(events: list[dict[str, Any]], expected: dict[str, float]) -> dict[str, Any] | None:
    """Feed the console's tracker the compile's events as they were stamped; at the event that
    takes the finished programs to half, its ETA and the serial sum's against what was left."""
    from console.data.launch_state import FINISHED, ProgramStates

    pool = ProgramStates()
    logs = [e for e in events if (e.get("detail") or {}).get("state") and (e.get("detail") or {}).get("program")]
    programs = {e["detail"]["program"] for e in logs} - {"*"}
    end = max(e["ts"] for e in logs)
    for e in logs:
        detail = dict(e["detail"])
        if detail["state"] == "queued":
            detail["expected_s"] = expected.get(detail["program"])
        pool.feed(detail, e["ts"])
        if len(pool.finished & programs) * 2 >= len(programs):
            left = [n for n in programs if pool.states.get(n) not in FINISHED]
            return {"at_s": e["ts"] - logs[0]["ts"], "actual_left_s": end - e["ts"], "eta_s": pool.eta(e["ts"]) or 0.0,
                    "serial_eta_s": sum(expected.get(n, 0.0) for n in left), "programs": len(programs),
                    "workers": pool.workers, "scale": pool.scale()}
    return None


def replay(events: list[dict[str, Any]], expected: dict[str, float]) -> dict[str, Any]:
    """The console tracker's ETA and the serial sum's at the half-way event, against what was
    really left."""
    half = _half_way(events, expected)
    if half is None:
        raise RuntimeError("the compile never reached half its programs")
    half = {k: round(v, 3) if isinstance(v, float) else v for k, v in half.items()}
    actual = max(half["actual_left_s"], 1e-3)
    half["error"] = round(half["eta_s"] / actual - 1, 3)
    half["serial_error"] = round(half["serial_eta_s"] / actual - 1, 3)
    return half


def measure(backend: str = "export", jobs: int = 2) -> dict[str, Any]:
    from runtime.programs.pool import compile_history

    with tempfile.TemporaryDirectory(prefix="dsv4-eta-bench-") as tmp:
        base = Path(tmp)
        model = base / "model"
        subprocess.run([sys.executable, "-m", "console.cli", "synth", "--preset", "tiny", str(model)], check=True,
                       capture_output=True)
        _compile(model, base / "first", backend, jobs)
        names = [p.name for p in (base / "first").glob("v*/*") if p.is_dir() and not p.name.startswith(".")]
        expected = {n: s for n, (s, _) in compile_history(base / "first", names).items()}
        events = _compile(model, base / "second", backend, jobs)
    result = replay(events, expected)
    return {"backend": backend, "jobs": jobs, **result, "target": TARGET,
            "met": abs(result["error"]) <= TARGET}


def main(json_output: bool = False, backend: str = "export", jobs: int = 2) -> int:
    from bench.report import print_table

    r = measure(backend, jobs)
    if json_output:
        print(json.dumps(r, indent=2))
        return 0
    print_table(f"compile ETA at half-way ({r['programs']} programs, {r['workers']} workers, {backend})",
                ("ETA", "says left", "really left", "error", "target", "met"),
                [("the console's (spread over the workers, at the rate seen)", f"{r['eta_s']:.1f} s",
                  f"{r['actual_left_s']:.1f} s", f"{r['error']:+.0%}", f"±{TARGET:.0%}", "yes" if r["met"] else "NO"),
                 ("baseline: expected seconds summed", f"{r['serial_eta_s']:.1f} s", f"{r['actual_left_s']:.1f} s",
                  f"{r['serial_error']:+.0%}", "", "")])
    return 0
