"""`dsv4 bench plan`: a fresh-process `dsv4 plan --json` on the small preset's layout and on the
full V4-Flash layout (sparse header-only shards: the plan reads headers, sizes and mtimes only).

Targets (issue 10): ≤ 0.5 s for small and ≤ 2 s for V4-Flash, process start included.
It also reports what a prepack would write (the plan's `sidecar.expected_bytes`) against the
checkpoint's bytes (target, issue 24: ≤ 1.02×), and V4-Flash's bytes per tensor family.
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
SIZE_TARGET = 1.02  # sidecar bytes / checkpoint bytes


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


def family_rows(raw_config: dict[str, Any]) -> tuple[list[tuple], dict[str, Any]]:
    """Checkpoint and packed bytes per tensor family (a RULES row) of one layout, largest first."""
    from runtime.model.config import from_dict
    from runtime.weights.layout import PackedLayout

    families = PackedLayout(from_dict(raw_config)).family_bytes()
    rows = [(family, f"{ckpt / 2**20:,.1f} MiB", f"{packed / 2**20:,.1f} MiB", f"{packed / ckpt:.3f}×")
            for family, (ckpt, packed) in sorted(families.items(), key=lambda kv: -kv[1][0])]
    return rows, {family: {"checkpoint_bytes": c, "packed_bytes": p} for family, (c, p) in families.items()}


def main(runs: int = 5, as_json: bool = False) -> int:
    from bench.report import print_json, print_table
    from runtime.synth.checkpoint import V4_FLASH, preset_config_dict

    rows, sizes, report = [], [], {}
    with tempfile.TemporaryDirectory(prefix="dsv4-bench-plan-") as tmp:
        for case, raw in (("small", preset_config_dict("small")), ("v4-flash", V4_FLASH)):
            model = Path(tmp) / case
            nbytes = header_only_checkpoint(model, raw)
            times, data = _time_plan(model, Path(tmp) / "kc", runs)
            median = statistics.median(times)
            side = data.get("sidecar", {})
            expected, ckpt = side.get("expected_bytes"), side.get("checkpoint_bytes")
            ratio = expected / ckpt if expected and ckpt else None
            report[case] = {"median_s": median, "runs": times, "checkpoint_bytes": nbytes,
                            "programs": len(data.get("programs", [])), "in_process_s": data.get("seconds"),
                            "problems": data.get("problems"), "target_s": TARGETS[case],
                            "sidecar_expected_bytes": expected, "sidecar_checkpoint_bytes": ckpt,
                            "sidecar_ratio": ratio, "sidecar_target": SIZE_TARGET}
            rows.append((case, f"{nbytes / 2**30:.1f} GiB", len(data.get("programs", [])),
                         f"{median:.3f} s", f"{min(times):.3f} s", f"{data.get('seconds') or 0:.3f} s",
                         f"≤ {TARGETS[case]} s", "met" if median <= TARGETS[case] else "MISSED"))
            sizes.append((case, f"{(ckpt or 0) / 2**30:.2f} GiB", f"{(expected or 0) / 2**30:.2f} GiB",
                          f"{ratio:.4f}×" if ratio else "-", f"≤ {SIZE_TARGET}×",
                          "met" if ratio and ratio <= SIZE_TARGET else "MISSED"))
    families, report["v4-flash"]["families"] = family_rows(V4_FLASH)
    if as_json:
        print_json(report)
    else:
        print_table(f"dsv4 plan --json, fresh process, median of {runs}",
                    ("layout", "checkpoint", "programs", "median", "best", "plan only", "target", ""), rows)
        print_table("the sidecar a prepack writes (plan: sidecar.expected_bytes) against the checkpoint's tensors",
                    ("layout", "checkpoint", "sidecar", "ratio", "target", ""), sizes)
        print_table("V4-Flash bytes per tensor family (tid2eid: int64 ids narrowed to int32)",
                    ("family", "checkpoint", "sidecar", "ratio"), families)
    return 0
