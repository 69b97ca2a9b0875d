"""One host's snapshot: every pane's data as frozen, keyword-only values, the same on both sides
of an SSH connection (`dsv4 snapshot` writes `to_json`, the console reads `from_json`).

The parts: the plan of the next launch (`runtime.launch.plan_report`: each program's state and
why, the sidecar verdict, the KV budget, the problems), the kernel cache's entries, the
sidecars, host and device figures, the registration prediction with the launches it compares
with (`records.LaunchRecord`), the services and their ranks, the service nodes, and the launch
history when asked. The schema is versioned: the previous version (5: the same parts as dicts)
still reads; a newer one is a `SnapshotVersionError` naming both, never misread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from console.data.cache import CacheSnapshot
from console.data.host import DeviceSnapshot, HostSnapshot
from console.data.nodes import NodeView
from console.data.records import LaunchRecord
from console.data.services import ServicesSnapshot
from runtime.launch.plan_report import PLAN_FAILED, PlanReport, Problem, ProgramPlan, SidecarPlan
from runtime.launch.spec import LaunchSpec
from runtime.programs.outcome import Outcome

SCHEMA_VERSION = 6  # 6: every part typed (plan report 2, problems a kind and a sentence); 5: parts as dicts
READS = (5, SCHEMA_VERSION)
LOCAL = "local"


class SnapshotVersionError(ValueError):
    """A snapshot of another schema version (another dsv4 on that host): said, never a KeyError."""


@dataclass(frozen=True, kw_only=True)
class ProgramsSnapshot:
    root: str
    entries: tuple[ProgramPlan, ...] = ()  # the plan's programs
    warning: str = ""
    problem: Problem | None = None  # what stops the launch before its programs (the checkpoint, the plan)

    def by_state(self) -> dict[str, int]:
        counts = Counter(e.state for e in self.entries)
        return {s.value: counts[s] for s in Outcome if counts[s]}

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "entries": [e.to_json() for e in self.entries], "warning": self.warning,
                "problem": self.problem.to_json() if self.problem else None}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ProgramsSnapshot:
        problem = raw.get("problem") or raw.get("error") or None  # v5: `error`, the problems' lines joined
        return cls(root=str(raw.get("root") or ""),
                   entries=tuple(ProgramPlan.from_json(e) for e in raw.get("entries") or ()),
                   warning=str(raw.get("warning") or ""), problem=Problem.from_json(problem) if problem else None)


@dataclass(frozen=True, kw_only=True)
class OtherSidecar:
    """A sidecar file beside the checkpoint that the next launch does not use (another rank count)."""

    path: str
    size_bytes: int = 0
    ranks: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size_bytes": self.size_bytes, "ranks": self.ranks}


@dataclass(frozen=True, kw_only=True)
class SidecarsSnapshot:
    model_dir: str
    wanted: SidecarPlan | None = None  # the sidecar the next launch maps or replaces, its residency sampled now
    others: tuple[OtherSidecar, ...] = ()
    error: str = ""
    disk_free: int | None = None  # on the filesystem the next launch's sidecar is (or would be) written to

    def to_json(self) -> dict[str, Any]:
        return {"model_dir": self.model_dir, "wanted": self.wanted.to_json() if self.wanted else None,
                "others": [o.to_json() for o in self.others], "error": self.error, "disk_free": self.disk_free}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SidecarsSnapshot:
        if "sidecars" in raw:  # v5: one list of rows, the wanted one marked
            rows = list(raw.get("sidecars") or ())
            wanted = next((SidecarPlan.from_json(r) for r in rows if r.get("wanted")), None)
            others = tuple(OtherSidecar(path=str(r["path"]), size_bytes=int(r.get("size_bytes") or 0))
                           for r in rows if not r.get("wanted"))
        else:
            wanted = SidecarPlan.from_json(raw["wanted"]) if raw.get("wanted") else None
            others = tuple(OtherSidecar(**{k: o[k] for k in ("path", "size_bytes", "ranks") if k in o})
                           for o in raw.get("others") or ())
        return cls(model_dir=str(raw.get("model_dir") or ""), wanted=wanted, others=others,
                   error=str(raw.get("error") or ""), disk_free=raw.get("disk_free"))


@dataclass(frozen=True, kw_only=True)
class RegistrationSnapshot:
    previous: LaunchRecord | None = None  # the last launch like the next one
    best_warm: LaunchRecord | None = None  # the fastest ok launch with every program HIT and weights MAP
    prediction: Mapping[str, str] = field(default_factory=dict)  # phase → the plan's path for it, in words
    basis: str = ""  # what the predicted seconds are based on
    earlier: LaunchRecord | None = None  # the launch before `previous`
    predicted: Mapping[str, float | None] = field(default_factory=dict)  # phase → seconds (the plan's)

    def to_json(self) -> dict[str, Any]:
        def record(r: LaunchRecord | None) -> dict[str, Any] | None:
            return r.to_json() if r else None

        return {"previous": record(self.previous), "best_warm": record(self.best_warm), "earlier": record(self.earlier),
                "prediction": dict(self.prediction), "basis": self.basis, "predicted": dict(self.predicted)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RegistrationSnapshot:
        def record(key: str) -> LaunchRecord | None:
            return LaunchRecord.from_json(raw[key]) if isinstance(raw.get(key), Mapping) else None

        return cls(previous=record("previous"), best_warm=record("best_warm"), earlier=record("earlier"),
                   prediction={str(k): str(v) for k, v in (raw.get("prediction") or {}).items()},
                   basis=str(raw.get("basis") or ""), predicted=dict(raw.get("predicted") or {}))


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    ts: float
    settings: LaunchSpec  # the launch it is of, its model, cache dir and device resolved
    programs: ProgramsSnapshot
    sidecars: SidecarsSnapshot
    host: HostSnapshot
    device: DeviceSnapshot
    registration: RegistrationSnapshot
    services: ServicesSnapshot = field(default_factory=ServicesSnapshot)
    plan: PlanReport | None = None
    cache: CacheSnapshot = field(default_factory=CacheSnapshot)  # every entry under the kernel cache root
    host_name: str = LOCAL  # which host this is the snapshot of (this one: local; a fleet's: its name)
    hostname: str = ""  # what that host calls itself (the name its ranks and events carry)
    toolchain: Mapping[str, str] = field(default_factory=dict)  # dsv4, torch, python, device, compiler, env
    nodes: tuple[NodeView, ...] = ()  # service nodes `dsv4 node start` runs here
    history: tuple[LaunchRecord, ...] = ()  # the launch history's last records, when asked for

    def blocking(self) -> Problem | None:
        """What stops a launch on this host before it starts, in its words (None: nothing)."""
        if self.plan is not None:
            return self.plan.blocking()
        return self.programs.problem or Problem(kind=PLAN_FAILED, text="no plan")

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "host_name": self.host_name, "hostname": self.hostname, "ts": self.ts,
                "settings": self.settings.to_json(), "toolchain": dict(self.toolchain),
                "nodes": [n.to_json() for n in self.nodes], "history": [r.to_json() for r in self.history],
                "plan": self.plan.to_json() if self.plan else None, "services": self.services.to_json(),
                "programs": self.programs.to_json(), "cache": self.cache.to_json(), "sidecars": self.sidecars.to_json(),
                "host": self.host.to_json(), "device": self.device.to_json(),
                "registration": self.registration.to_json()}

    @classmethod
    def from_json(cls, raw: Any, host_name: str | None = None) -> Snapshot:
        """`to_json`'s inverse (another host's snapshot, read over SSH), and version 5's reading;
        another version is a SnapshotVersionError naming both."""
        if not isinstance(raw, dict) or "v" not in raw:
            raise SnapshotVersionError("not a dsv4 snapshot (no version)")
        if raw["v"] not in READS:
            newer = "a newer" if isinstance(raw["v"], int) and raw["v"] > SCHEMA_VERSION else "an older"
            raise SnapshotVersionError(f"another version of the snapshot: v{raw['v']} there ({newer} dsv4), "
                                       f"v{SCHEMA_VERSION} here")
        tool = raw.get("toolchain") or {}
        if not isinstance(tool, dict) or not all(isinstance(v, str) for v in tool.values()):
            raise ValueError("toolchain: not a mapping of component to text")
        if not all(isinstance(x, dict) for k in ("nodes", "history") for x in raw.get(k) or ()):
            raise ValueError("nodes and history are lists of records")
        return cls(ts=float(raw.get("ts") or 0.0), settings=LaunchSpec.from_json(raw.get("settings") or {}),
                   programs=ProgramsSnapshot.from_json(raw.get("programs") or {}),
                   sidecars=SidecarsSnapshot.from_json(raw.get("sidecars") or {}),
                   host=HostSnapshot.from_json(raw.get("host") or {}),
                   device=DeviceSnapshot.from_json(raw.get("device") or {}),
                   registration=RegistrationSnapshot.from_json(raw.get("registration") or {}),
                   services=ServicesSnapshot.from_json(raw.get("services") or {}),
                   plan=PlanReport.from_json(raw["plan"]) if raw.get("plan") else None,
                   cache=CacheSnapshot.from_json(raw.get("cache") or {}),
                   host_name=host_name or str(raw.get("host_name") or LOCAL), hostname=str(raw.get("hostname") or ""),
                   toolchain=dict(tool), nodes=tuple(NodeView.from_json(n) for n in raw.get("nodes") or ()),
                   history=tuple(LaunchRecord.from_json(r) for r in raw.get("history") or ()))
