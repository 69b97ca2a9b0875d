"""Counts for docs/reliability.md: each reliability test records what it ran and what happened.

One JSON line per fault class goes to `<pytest basetemp>/reliability-counts.jsonl` (and to
$DSV4_RELIABILITY_COUNTS when set, to collect a run's counts) and is printed (`pytest -s`).
Outcomes: recovered (the operation or the next run succeeded with correct data), clean_error
(one clear error / a MISS / a REPACK, nothing lost), data_lost (must be 0), skipped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def record(tmp_path_factory, fault: str, *, injection: str, trials: int, recovered: int = 0,
           clean_error: int = 0, data_lost: int = 0, skipped: int = 0, seed: int | None = None,
           note: str = "") -> dict:  # fmt: skip
    row = {
        "fault": fault, "injection": injection, "trials": trials, "recovered": recovered,
        "clean_error": clean_error, "data_lost": data_lost, "skipped": skipped, "seed": seed,
        "note": note,
    }  # fmt: skip
    line = json.dumps(row, sort_keys=True)
    paths = [Path(tmp_path_factory.getbasetemp()) / "reliability-counts.jsonl"]
    if os.environ.get("DSV4_RELIABILITY_COUNTS"):
        paths.append(Path(os.environ["DSV4_RELIABILITY_COUNTS"]))
    for p in paths:
        with open(p, "a") as f:
            f.write(line + "\n")
    print(f"RELIABILITY {line}")
    return row
