"""`dsv4 bench plan`: a fresh-process `dsv4 plan --json` on the small preset's layout and on the
full V4-Flash layout (sparse header-only shards: the plan reads headers, sizes and mtimes only).

Targets (issue 10): ≤ 0.5 s for small and ≤ 2 s for V4-Flash, process start included.
"""

from __future__ import annotations

import json
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TARGETS = {"small": 0.5, "v4-flash": 2.0}


def header_only_checkpoint(root: Path, raw_config: dict[str, Any]) -> int:
    """A checkpoint whose one shard is a sparse file of the right size with a real header:
    contract checks and plans read only headers, so even V4-Flash costs no disk. Returns bytes."""
    from runtime.model.config import from_dict
    from runtime.model.tensors import expected_tensors

    specs = expected_tensors(from_dict(raw_config))
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(raw_config))
    header, offset = {}, 0
    for s in specs:
        header[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    blob = json.dumps(header).encode()
    with open(root / "model-00001-of-00001.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    weight_map = {s.name: "model-00001-of-00001.safetensors" for s in specs}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return offset


def _time_plan(model: Path, cache: Path, runs: int) -> tuple[list[float], dict[str, Any]]:
    times, data = [], {}
    for _ in range(runs):
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "console.cli", "plan", str(model), "--json",
                              "--kernel-cache-dir", str(cache), "--max-seq", "4096"],
                             capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        data = json.loads(out.stdout) if out.stdout.strip() else {"problems": [out.stderr.strip()]}
    return times, data


def main(runs: int = 5, as_json: bool = False) -> int:
    from bench.report import print_json, print_table
    from runtime.synth.checkpoint import V4_FLASH, preset_config_dict

    rows, report = [], {}
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-plan-") as tmp:
        for case, raw in (("small", preset_config_dict("small")), ("v4-flash", V4_FLASH)):
            model = Path(tmp) / case
            nbytes = header_only_checkpoint(model, raw)
            times, data = _time_plan(model, Path(tmp) / "kc", runs)
            median = statistics.median(times)
            report[case] = {"median_s": median, "runs": times, "checkpoint_bytes": nbytes,
                            "programs": len(data.get("programs", [])), "in_process_s": data.get("seconds"),
                            "problems": data.get("problems"), "target_s": TARGETS[case]}
            rows.append((case, f"{nbytes / 1e9:.1f} GB", len(data.get("programs", [])),
                         f"{median:.3f} s", f"{min(times):.3f} s", f"{data.get('seconds') or 0:.3f} s",
                         f"≤ {TARGETS[case]} s", "met" if median <= TARGETS[case] else "MISSED"))
    if as_json:
        print_json(report)
    else:
        print_table(f"dsv4 plan --json, fresh process, median of {runs}",
                    ("layout", "checkpoint", "programs", "median", "best", "plan only", "target", ""), rows)
    return 0
