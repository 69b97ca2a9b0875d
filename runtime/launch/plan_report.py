"""The plan of the next launch as values that travel: what `dsv4 plan --json` prints, what a
launch's check event and the console's snapshot carry (over SSH too), read back by `from_json`.

Frozen, keyword-only parts both sides import (SGLang's `io_struct` is the example): each
program's state and why (`ProgramPlan`), the sidecar verdict with what a prepack would write
(`SidecarPlan`), the KV budget of every rank (`KvPlan`, `RankKv`), and the problems a launch
would fail on, each a kind and a sentence (`Problem`). `PlanReport` is the whole of it; the
builder (`runtime.launch.plan.Plan`) keeps beside it what a launch acts on and never travels.

The JSON is versioned (`REPORT_VERSION`): 2 writes problems as `{kind, text}`; a report of
version 1 (no `v`, problems as "kind: text" lines) still reads; a newer one is named, never
misread (`ReportVersionError`). Torch-free.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from runtime.launch.spec import LaunchSpec
from runtime.programs.outcome import Outcome
from store.sidecar.verdict import MAP, REPACK

REPORT_VERSION = 2  # 2: versioned, problems as {kind, text}; 1: unversioned, problems as "kind: text"
CHECK, KV, PLAN_FAILED = "check", "kv", "plan"  # the kinds of problem a plan names


class ReportVersionError(ValueError):
    """A plan report of a version this reader does not know: said, never misread."""


def _known(cls: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    return {f.name: raw[f.name] for f in fields(cls) if f.name in raw}


@dataclass(frozen=True, kw_only=True)
class Problem:
    """Why a launch would fail, before it starts: a kind (`check`, `kv`, `plan`) and a sentence."""

    kind: str
    text: str

    def line(self) -> str:
        return f"{self.kind}: {self.text}"

    def to_json(self) -> dict[str, str]:
        return {"kind": self.kind, "text": self.text}

    @classmethod
    def from_json(cls, raw: Any) -> Problem:
        if isinstance(raw, str):  # version 1 wrote the kind into the line: read once, at this boundary
            kind, sep, text = raw.partition(": ")
            if sep and kind in (CHECK, KV):
                return cls(kind=kind, text=text)
            if raw.startswith("plan failed"):
                return cls(kind=PLAN_FAILED, text=raw.removeprefix("plan failed: "))
            return cls(kind=CHECK, text=raw)
        return cls(kind=str(raw["kind"]), text=str(raw["text"]))


@dataclass(frozen=True, kw_only=True)
class ProgramPlan:
    """One program of the launch: its kernel-cache state for the live key, and why."""

    program: str
    state: Outcome
    fingerprint: str | None = None
    reason: str = ""
    entry: str | None = None  # the entry a HIT loads, or the corrupt entry a launch would replace
    size_bytes: int = 0  # a HIT's artifact bytes: what loading it reads

    def to_json(self) -> dict[str, Any]:
        return {"program": self.program, "state": self.state.value, "fingerprint": self.fingerprint,
                "reason": self.reason, "entry": self.entry, "size_bytes": self.size_bytes}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ProgramPlan:
        state = str(raw["state"])
        # a state this version does not name (a newer dsv4's): compiled, as far as this reader can tell
        return cls(**{**_known(cls, raw), "state": Outcome(state) if state in Outcome.__members__ else Outcome.MISS,
                      "program": str(raw["program"])})


@dataclass(frozen=True, kw_only=True)
class SidecarPlan:
    """The sidecar a launch maps or replaces: the verdict against the live source key (MAP, or
    REPACK and why), its residency, and what a prepack of it would write."""

    path: str
    verdict: str  # MAP | REPACK
    reason: str = ""  # REPACK's (missing, stale, cold, corrupt, names, disabled, source)
    detail: str = ""
    residency: float | None = None
    residency_method: str | None = None
    sampled_at: float | None = None  # when the residency was sampled (the console samples it anew)
    size_bytes: int = 0
    tensors: int = 0
    created: float | None = None
    pack_seconds: float | None = None
    changes: tuple[str, ...] = ()  # stale: each changed key component, "old → new"
    cold_read: bool = False  # MAP of a cold file: expect a read of the uncached bytes
    predicted_read_s: float | None = None
    predicted_pack_s: float | None = None
    read_bytes_per_s: float | None = None
    expected_bytes: int | None = None  # what a prepack writes (known before packing)
    checkpoint_bytes: int | None = None
    free_bytes: int | None = None  # in the directory it goes to
    fits: bool = True  # a prepack's bytes fit that free space

    @property
    def mapped(self) -> bool:
        return self.verdict == MAP

    def next_launch(self) -> str:
        """What the next launch does with it, in words."""
        if self.mapped:
            return f"{MAP} (cold: reads uncached bytes)" if self.cold_read else MAP
        return f"REPACK ({self.reason or '?'})"

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["changes"] = list(self.changes)
        out["age_seconds"] = None if self.created is None else max(0.0, time.time() - self.created)
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SidecarPlan:
        known = _known(cls, raw)
        known["changes"] = tuple(str(c) for c in raw.get("changes") or ())
        return cls(**{**known, "path": str(raw.get("path") or ""), "verdict": str(raw.get("verdict") or REPACK)})

    @classmethod
    def of(cls, verdict: Any, size: Any = None) -> SidecarPlan:
        """From a `store.sidecar.verdict.Verdict` and a prepack's `SidecarSize` (None: unknown)."""
        sized = size.to_json() if size is not None else {}
        own = {"verdict", "reason", "changes", *sized}  # what this value says its own way
        same = {f.name: getattr(verdict, f.name) for f in fields(cls) if f.name not in own and hasattr(verdict, f.name)}
        return cls(**same, verdict=str(verdict.action), reason=str(verdict.reason or ""),
                   changes=tuple(verdict.changes), **sized)


@dataclass(frozen=True, kw_only=True)
class RankKv:
    """One rank's KV budget on its device (`runtime.launch.budget.KvBudget`, as numbers)."""

    rank: int
    device: str = ""
    total: int = 0
    free: int = 0
    used: int = 0
    utilization: float = 0.0
    budget: int = 0
    slot_bytes: int = 0
    fits: int = 0
    slots: int = 0
    max_slots: int = 0
    share: int = 1  # ranks whose KV this memory holds
    problem: str = ""

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RankKv:
        return cls(**_known(cls, raw))

    @classmethod
    def of(cls, budget: Any) -> RankKv:
        return cls.from_json(budget.to_json())


@dataclass(frozen=True, kw_only=True)
class KvPlan:
    """The KV phase of the launch: each rank's budget and slots; the service's are their sum.
    Without a reading of the devices (`detail` says why), the slots are unknown."""

    slot_bytes: int | None = None
    slots: int | None = None
    fits: int | None = None
    max_seq: int = 0
    max_slots: int = 0
    ranks: int = 1
    per_rank: tuple[RankKv, ...] = ()
    problem: str = ""
    detail: str = ""  # why the slots are unknown
    source: str = ""  # meminfo | nvml | npu-smi

    @property
    def budget(self) -> int | None:
        return self.per_rank[0].budget if self.per_rank else None

    def to_json(self) -> dict[str, Any]:
        first = self.per_rank[0].to_json() if self.per_rank else {}
        out = {k: first.get(k) for k in ("total", "free", "used", "utilization", "budget")}  # version 1's keys
        out.update({f.name: getattr(self, f.name) for f in fields(self)})
        out["per_rank"] = [r.to_json() for r in self.per_rank]
        return out

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> KvPlan:
        known = _known(cls, raw)
        known["per_rank"] = tuple(RankKv.from_json(r) for r in raw.get("per_rank") or ())
        return cls(**known)

    @classmethod
    def of(cls, kv: Any, source: str = "") -> KvPlan:
        """From `runtime.launch.budget.LaunchKv`."""
        return cls(slot_bytes=kv.slot_bytes, slots=kv.slots, fits=kv.fits, max_seq=kv.max_seq,
                   max_slots=kv.per_rank[0].max_slots if kv.per_rank else 0, ranks=kv.ranks,
                   per_rank=tuple(RankKv.of(b) for b in kv.per_rank), problem=kv.problem, source=source)


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """The plan of the next launch, whole, as it travels (see the module docstring)."""

    model: str
    spec: LaunchSpec
    device: str = "cpu"
    backend: str = "aoti"
    ready: str = "compiled"
    speculative: str = "off"  # `--speculative` resolved: mtp | off
    ranks_here: int = 1  # the service's ranks that run on this host (each sized on its devices)
    programs: tuple[ProgramPlan, ...] = ()
    sidecar: SidecarPlan | None = None
    kv: KvPlan | None = None
    predicted: Mapping[str, float | None] = field(default_factory=dict)  # phase → seconds
    basis: Mapping[str, str | None] = field(default_factory=dict)  # phase → history | model | None
    compared: Mapping[str, Any] | None = None  # the newest like launch: {started, pid}
    like: Any = None  # runtime.launch.history.Likeness (None: the plan failed)
    content: Mapping[str, Any] = field(default_factory=dict)  # store.content_id's JSON, shown as it is
    across_hosts: str = ""
    problems: tuple[Problem, ...] = ()
    seconds: float = 0.0

    def problem(self, kind: str) -> Problem | None:
        """The first problem of `kind` (check, kv, plan), or None."""
        return next((p for p in self.problems if p.kind == kind), None)

    def blocking(self) -> Problem | None:
        """What stops a launch before it starts (a check, then a plan that failed, then the KV)."""
        return self.problem(CHECK) or self.problem(PLAN_FAILED) or self.problem(KV)

    def to_json(self) -> dict[str, Any]:
        return {
            "v": REPORT_VERSION, "model": self.model, "spec": self.spec.to_json(), "device": self.device,
            "backend": self.backend, "ready": self.ready, "speculative": self.speculative,
            "ranks_here": self.ranks_here, "programs": [p.to_json() for p in self.programs],
            "sidecar": self.sidecar.to_json() if self.sidecar else {}, "kv": self.kv.to_json() if self.kv else {},
            "predicted": dict(self.predicted), "basis": dict(self.basis),
            "compared": dict(self.compared) if self.compared is not None else None,
            "like": self.like.to_json() if self.like is not None else None, "content": dict(self.content),
            "across_hosts": self.across_hosts, "problems": [p.to_json() for p in self.problems],
            "seconds": round(self.seconds, 4),
        }

    @classmethod
    def from_json(cls, raw: Any) -> PlanReport:
        """`to_json`'s inverse; version 1 (unversioned) reads too; a newer version is a
        ReportVersionError naming both."""
        from runtime.launch.history import Likeness

        if not isinstance(raw, Mapping):
            raise ValueError("a plan report is a JSON object")
        version = raw.get("v", 1)
        if version not in (1, REPORT_VERSION):
            raise ReportVersionError(f"a plan of version {version} (another dsv4); this reader takes "
                                     f"{REPORT_VERSION} and 1")
        spec = LaunchSpec.from_json(raw.get("spec") or {"model": raw.get("model")})
        return cls(model=str(raw.get("model") or spec.model or ""), spec=spec,
                   device=str(raw.get("device") or "cpu"), backend=str(raw.get("backend") or ""),
                   ready=str(raw.get("ready") or "compiled"), speculative=str(raw.get("speculative") or "off"),
                   ranks_here=int(raw.get("ranks_here") or spec.ranks),
                   programs=tuple(ProgramPlan.from_json(p) for p in raw.get("programs") or ()),
                   sidecar=SidecarPlan.from_json(raw["sidecar"]) if raw.get("sidecar") else None,
                   kv=KvPlan.from_json(raw["kv"]) if raw.get("kv") else None,
                   predicted=dict(raw.get("predicted") or {}), basis=dict(raw.get("basis") or {}),
                   compared=dict(raw["compared"]) if isinstance(raw.get("compared"), Mapping) else None,
                   like=Likeness.from_json(raw.get("like")), content=dict(raw.get("content") or {}),
                   across_hosts=str(raw.get("across_hosts") or ""),
                   problems=tuple(Problem.from_json(p) for p in raw.get("problems") or ()),
                   seconds=float(raw.get("seconds") or 0.0))
