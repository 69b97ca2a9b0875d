"""The launch history's records: what one line says about a launch, written once, read by the
plan's predictions and the console (torch-free; the file itself is `store.history`'s)."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from runtime.events import PHASES
from runtime.programs.outcome import Outcome
from store import history
from store.sidecar import MAP


def append(spec, phases: dict[str, dict[str, Any]], started: float, outcome: str, error: str = "", *,
           device: str, backend: str, extra: dict[str, Any] | None = None) -> None:
    """One JSON line per launch (O_APPEND: concurrent launches never interleave). `device` and
    `backend` as the launch resolved them (never `auto`)."""
    from runtime.model.config import synthetic_preset

    history.append({
        "v": 1, "started": round(started, 3), "ended": round(time.time(), 3), "host": socket.gethostname(),
        "pid": os.getpid(), "model": str(spec.model), "preset": synthetic_preset(spec.model), "device": device,
        "backend": backend, "cache_dir": str(spec.kernel_cache_dir or ""), "sidecar": spec.use_sidecar,
        "ranks": spec.ranks, "max_seq": spec.max_seq, "outcome": outcome, "error": error, "phases": phases,
        **(extra or {}),
    })


def program_outcomes(record: dict[str, Any]) -> dict[str, str]:
    """Each program's outcome in a launch, as it happened."""
    programs = ((record.get("phases") or {}).get("programs") or {}).get("programs") or {}
    return {str(k): str(v) for k, v in programs.items()} if isinstance(programs, dict) else {}


def recompiled(record: dict[str, Any]) -> bool:
    """Whether the launch compiled any program (a MISS, STALE, CORRUPT or UNTRUSTED one). Read
    from each program's own outcome, so a launch that replaced a corrupt entry is never taken
    for one that only loaded."""
    def compiles(outcome: str) -> bool:  # an outcome this version does not name: assume it did
        return outcome not in Outcome.__members__ or Outcome(outcome).compiles

    outcomes = program_outcomes(record)
    if outcomes:
        return any(compiles(o) for o in outcomes.values())
    counts = ((record.get("phases") or {}).get("programs") or {}).get("counts") or {}
    return any(n and compiles(k) for k, n in counts.items())


def weights_path(record: dict[str, Any]) -> str | None:
    return ((record.get("phases") or {}).get("weights") or {}).get("path")


def is_warm(record: dict[str, Any]) -> bool:
    """A successful launch that compiled nothing and mapped its sidecar: the fast path."""
    return record.get("outcome") == "ok" and not recompiled(record) and weights_path(record) == MAP


def launch_seconds(record: dict[str, Any]) -> float:
    """The seconds of every phase the launch ran, through serve."""
    phases = record.get("phases") or {}
    return sum(float((phases.get(p) or {}).get("seconds") or 0) for p in PHASES)
