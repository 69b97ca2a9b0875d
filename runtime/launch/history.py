"""The launch history's records: what one line says about a launch, written once, read by the
plan's predictions and the console (torch-free; the file itself is `store.history`'s).

Launches are compared like with like: `comparable` is the one matcher (the plan's predictions,
the console's "compared" and "best warm" launch). Two launches are alike when their settings
are — model, backend and device as resolved, ranks, max_seq, sidecar use and path — and, for the
programs and weights phases, when they took the same path there (compiled something or not,
MAP or REPACK). A record without a setting (one an older dsv4 wrote) is like nothing. A launch
that registered predicts like one whatever ended it later (`registered`): a service killed after
a day of serving took the phases it took.

One launch, one set of numbers: a launch of several ranks records each phase's seconds as its
slowest rank's (`slowest`, with every rank's beside them) — what its Registration pane showed —
its whole seconds (`seconds`: from the service's process start to serving), and its registration
span beside the plan's prediction of the same span (`span`: check, programs ∥ weights, upload,
kv, validate), so "predicted · actual" compares like with like.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from typing import Any

from runtime.events import PHASES, Phase
from runtime.programs.outcome import Outcome
from store import history
from store.sidecar import MAP

SETTINGS = ("model", "backend", "device", "ranks", "max_seq", "sidecar", "sidecar_path")
SERVICE_LAUNCH: str | None = None  # set by a `dsv4 serve` process: its service's identity (one launch)


def settings(spec, device: str, backend: str, sidecar_path: str | None = None) -> dict[str, Any]:
    """What makes two launches alike (SETTINGS), as a record keeps it."""
    from store.sidecar import default_sidecar_path

    path = sidecar_path or str(default_sidecar_path(spec.model, spec.ranks))
    return {"model": str(spec.model), "backend": backend, "device": device, "ranks": spec.ranks,
            "max_seq": spec.max_seq, "sidecar": spec.use_sidecar, "sidecar_path": path}


def plan_settings(plan) -> dict[str, Any]:
    return settings(plan.spec, plan.device, plan.backend, plan.sidecar.path if plan.sidecar is not None else None)


def append(spec, phases: dict[str, dict[str, Any]], started: float, outcome: str, error: str = "", *,
           device: str, backend: str, predicted: dict[str, Any] | None = None,
           extra: dict[str, Any] | None = None, config=None) -> None:
    """One JSON line per launch (O_APPEND: concurrent launches never interleave): its settings
    (`device` and `backend` as the launch resolved them, never `auto`), every phase's record,
    and the prediction made for it. `config`: the launch's parsed config.json, whose synthetic
    preset the record names (None: a launch that never read it)."""
    from store.services import ServiceId

    service = ServiceId.of_this_process()
    # every line of one service's launch carries its identity, by whichever of its processes writes
    # it; a launch run inside another program (a test, a bench) is its own by its start time
    launch = SERVICE_LAUNCH or f"{service.key}/{started:.3f}"
    history.append({
        "v": 1, "launch": launch, "started": round(started, 3), "ended": round(time.time(), 3),
        "host": socket.gethostname(), "pid": service.pid, **settings(spec, device, backend),
        "preset": getattr(config, "synthetic", None),
        "cache_dir": str(spec.kernel_cache_dir or ""), "outcome": outcome, "error": error, "phases": phases,
        "predicted": predicted or {}, **(extra or {}),
    })


@dataclass(frozen=True)
class Likeness:
    """What a launch must share with another to predict it: its settings, and its paths (whether
    it compiles anything, MAP or REPACK). The plan makes it (`likeness`) and carries it in its
    JSON, so the console compares by the very same value."""

    settings: dict[str, Any]
    compiles: bool
    weights: str

    def to_json(self) -> dict[str, Any]:
        return {"settings": self.settings, "compiles": self.compiles, "weights": self.weights}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Likeness | None:
        try:
            return cls(dict(data["settings"]), bool(data["compiles"]), str(data["weights"]))
        except (TypeError, KeyError, ValueError):
            return None

    def same_paths(self, record: dict[str, Any]) -> bool:
        return recompiled(record) == self.compiles and weights_path(record) == self.weights


def likeness(plan) -> Likeness:
    return Likeness(plan_settings(plan), not plan.all_hit(), plan.weights_path())


def registered(record: dict[str, Any]) -> bool:
    """The launch registered: it served (its serve phase has its URL), whatever ended it later,
    or its outcome is ok."""
    serve = (record.get("phases") or {}).get(Phase.SERVE) or {}
    return record.get("outcome") == "ok" or bool(serve.get("url"))


def comparable(history: list[dict[str, Any]], like: Likeness | None, phase: str | None = None) -> list[dict[str, Any]]:
    """The launches that registered like `like` (oldest first): the same settings and, for
    `phase` programs or weights, the same path through it; [] for no likeness (a plan that failed)."""
    if like is None:
        return []
    out = []
    for record in history:
        if not registered(record) or any(record.get(k) != v for k, v in like.settings.items()):
            continue
        if phase == Phase.PROGRAMS and recompiled(record) != like.compiles:
            continue
        if phase == Phase.WEIGHTS and weights_path(record) != like.weights:
            continue
        out.append(record)
    return out


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
    """A launch that registered, compiled nothing and mapped its sidecar: the fast path."""
    return registered(record) and not recompiled(record) and weights_path(record) == MAP


def launch_seconds(record: dict[str, Any]) -> float:
    """The whole launch's seconds: from its process's start to serving (`seconds`); a record of an
    older dsv4 without them, the sum of its phases' through serve."""
    phases = record.get("phases") or {}
    return whole_seconds(record.get("seconds"), {p: (phases.get(p) or {}).get("seconds") for p in PHASES})


def whole_seconds(seconds: Any, phase_seconds: dict[str, Any]) -> float:
    """`launch_seconds` of a launch's parts as the console holds them: `seconds` where it is a
    number, else the sum of its phases' through serve."""
    if isinstance(seconds, int | float):
        return float(seconds)
    return sum(float(phase_seconds.get(p) or 0) for p in PHASES)


def span(seconds: dict[str, Any]) -> float | None:
    """Registration's span from each phase's seconds: check, then programs and weights side by
    side (the longer counts), then upload, kv and validate; None when a phase's are unknown. The
    one formula for a prediction (the plan's per phase) and for what a launch measured."""
    def of(phase: str) -> float | None:
        value = seconds.get(phase)
        value = value.get("seconds") if isinstance(value, dict) else value
        return float(value) if isinstance(value, int | float) else None

    parts = [of(p) for p in (Phase.CHECK, Phase.PROGRAMS, Phase.WEIGHTS, Phase.UPLOAD, Phase.KV, Phase.VALIDATE)]
    if any(p is None for p in parts):
        return None
    check, programs, weights, *rest = parts
    return round(check + max(programs, weights) + sum(rest), 4)


def slowest(phases: dict[str, dict[str, Any]], by_rank: dict[int, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Rank 0's phase records with each phase's seconds the slowest rank's (`by_rank`: each rank's
    seconds per phase, as it posted them), that rank and every rank's seconds beside them."""
    out = {}
    for phase, record in phases.items():
        times = {r: float(s[phase]) for r, s in sorted(by_rank.items()) if isinstance(s.get(phase), int | float)}
        if len(times) < 2:
            out[phase] = record
            continue
        rank = max(times, key=lambda r: times[r])
        out[phase] = {**record, "seconds": round(times[rank], 4), "slowest_rank": rank,
                      "by_rank": [times.get(r) for r in range(max(times) + 1)]}
    return out


def basis_line(basis: dict[str, str | None], compared: dict[str, Any] | None) -> str:
    """Where the predicted seconds come from, in words: a like launch, a cost model, or nothing."""
    modelled = [phase for phase, b in basis.items() if b == "model"]
    unknown = [phase for phase, b in basis.items() if b is None]
    if basis and len(unknown) == len(basis):
        return "no comparable launch: seconds unknown until one with these settings has run"
    if compared is not None:
        head = "from the last launch with these settings and paths"
    elif any(b == "history" for b in basis.values()):
        head = "from like launches, phase by phase"
    else:
        head = "no comparable launch"
    parts = [head]
    if modelled:
        parts.append(f"{', '.join(modelled)} from recorded compile seconds and throughput")
    if unknown:
        parts.append(f"{', '.join(unknown)} unknown until a launch with these settings")
    return "; ".join(parts)
