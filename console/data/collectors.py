"""Collectors: plain Python that returns immutable snapshots of what the console shows.

The Programs, Sidecars and Registration panes render the plan of the next launch
(`runtime.launch.plan`, torch-free, kept by `console.data.plan_watch`): nothing here judges a cache or
predicts a program outcome itself. Nothing imports torch or opens a device context. Panes only
render these snapshots, `--once --json` prints them (the plan under `plan`), and tests feed
fake ones. Every collector turns its own failure into an `error` string on its snapshot.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from console.data.cache import CacheSnapshot, free_bytes
from console.data.host import DeviceSnapshot, HostCollector, HostSnapshot, collect_device
from console.data.nodes import node_views
from console.data.plan_watch import PlanWatch
from console.data.services import ServicesCollector, ServicesSnapshot
from runtime.launch.history import Likeness, basis_line, comparable, is_warm, launch_seconds
from runtime.launch.spec import LaunchSpec
from runtime.programs.outcome import Outcome
from runtime.serve.access import Access
from store import sidecar as sc
from store.paths import default_model_dir, default_preset, kernel_cache_dir  # noqa: F401
from store.sidecar.verdict import MAP, REPACK
from store.units import format_size

HISTORY_SHIPPED = 50  # launch records a snapshot carries when asked for them
RESIDENCY_DRIFT = 0.02  # a fresh sample this far from the plan's re-plans (hot/cold may have flipped)
SCHEMA_VERSION = 5  # 5: `hostname`, `toolchain`, `nodes`, the sidecar's free disk; from_json
LOCAL = "local"


class SnapshotVersionError(ValueError):
    """A snapshot of another schema version (another dsv4 on that host): said, never a KeyError."""


def resolved(spec: LaunchSpec) -> LaunchSpec:
    """The console's launch spec with its paths resolved (the embedded default model, the kernel
    cache dir the environment names): what every action it starts is told, explicitly."""
    return spec.with_(model=Path(spec.model) if spec.model else default_model_dir(),
                      kernel_cache_dir=kernel_cache_dir(spec.kernel_cache_dir))


def console_spec(model: Path | str | None = None, kernel_cache: Path | str | None = None, **kw: Any) -> LaunchSpec:
    """`resolved(LaunchSpec(…))`, for the console's tests and tools."""
    return resolved(LaunchSpec(model=Path(model) if model else None,
                               kernel_cache_dir=Path(kernel_cache) if kernel_cache else None, **kw))


@dataclass(frozen=True)
class ProgramsSnapshot:
    root: str
    entries: tuple[dict[str, Any], ...] = ()  # the plan's programs: program, state, fingerprint, reason, entry
    warning: str = ""
    error: str = ""

    def totals(self) -> dict[str, Any]:
        counts = Counter(e["state"] for e in self.entries)
        return {"programs": len(self.entries), "by_state": {s.value: counts[s] for s in Outcome if counts[s]}}


@dataclass(frozen=True)
class SidecarsSnapshot:
    model_dir: str
    sidecars: tuple[dict[str, Any], ...] = ()  # the plan's sidecar + sampled_at/next_launch/wanted; other files
    judged_against: str = "the live checkpoint and packer (the plan)"
    error: str = ""
    disk_free: int | None = None  # on the filesystem the next launch's sidecar is (or would be) written to

    def wanted(self) -> dict[str, Any] | None:
        """The sidecar the next launch maps or replaces."""
        return next((r for r in self.sidecars if r.get("wanted")), None)


@dataclass(frozen=True)
class RegistrationSnapshot:
    previous: dict[str, Any] | None = None  # launch-history record of the last launch of this model
    best_warm: dict[str, Any] | None = None  # the fastest ok launch with every program HIT and weights MAP
    prediction: dict[str, str] = field(default_factory=dict)  # phase → the plan's path for it
    basis: str = ""  # what the prediction is based on
    earlier: dict[str, Any] | None = None  # the launch before `previous`
    predicted: dict[str, float | None] = field(default_factory=dict)  # phase → seconds (the plan's)


@dataclass(frozen=True)
class Snapshot:
    ts: float
    settings: dict[str, Any]
    programs: ProgramsSnapshot
    sidecars: SidecarsSnapshot
    host: HostSnapshot
    device: DeviceSnapshot
    registration: RegistrationSnapshot
    services: ServicesSnapshot = field(default_factory=ServicesSnapshot)
    plan: dict[str, Any] | None = None  # runtime.launch.plan.Plan.to_json()
    cache: CacheSnapshot = field(default_factory=CacheSnapshot)  # every entry under the kernel cache root
    host_name: str = LOCAL  # which host this is the snapshot of (this one: local; a fleet's: its name)
    hostname: str = ""  # what that host calls itself (the name its ranks and events carry)
    toolchain: dict[str, str] = field(default_factory=dict)  # dsv4, torch, python, device, compiler, env
    nodes: tuple[dict[str, Any], ...] = ()  # service nodes `dsv4 node start` runs here (store.nodes)
    history: tuple[dict[str, Any], ...] = ()  # the launch history's last records, when asked for (a fleet's `h`)

    PARTS: ClassVar[tuple[str, ...]] = ("programs", "cache", "sidecars", "host", "device", "registration")

    def to_json(self) -> dict[str, Any]:
        return {"v": SCHEMA_VERSION, "host_name": self.host_name, "hostname": self.hostname, "ts": self.ts,
                "settings": self.settings, "toolchain": self.toolchain, "nodes": list(self.nodes),
                "history": list(self.history),
                "plan": self.plan, "services": self.services.to_json(),
                **{k: dataclasses.asdict(getattr(self, k)) for k in self.PARTS}}

    @classmethod
    def from_json(cls, raw: dict[str, Any], host_name: str | None = None) -> Snapshot:
        """`to_json`'s inverse (another host's snapshot, read over SSH); one of another schema
        version is a SnapshotVersionError naming both versions."""
        if not isinstance(raw, dict) or "v" not in raw:
            raise SnapshotVersionError("not a dsv4 snapshot (no version)")
        if raw["v"] != SCHEMA_VERSION:
            newer = "a newer" if isinstance(raw["v"], int) and raw["v"] > SCHEMA_VERSION else "an older"
            raise SnapshotVersionError(f"another version of the snapshot: v{raw['v']} there ({newer} dsv4), "
                                       f"v{SCHEMA_VERSION} here")
        tool = raw.get("toolchain") or {}
        if not isinstance(tool, dict) or not all(isinstance(v, str) for v in tool.values()):
            raise ValueError("toolchain: not a mapping of component to text")
        if not all(isinstance(x, dict) for k in ("nodes", "history") for x in raw.get(k) or ()):
            raise ValueError("nodes and history are lists of records")
        types = {"programs": ProgramsSnapshot, "cache": CacheSnapshot, "sidecars": SidecarsSnapshot,
                 "host": HostSnapshot, "device": DeviceSnapshot, "registration": RegistrationSnapshot}
        parts = {k: value_of(types[k], raw.get(k) or {}) for k in cls.PARTS}
        return cls(float(raw.get("ts") or 0.0), dict(raw.get("settings") or {}), parts["programs"],
                   parts["sidecars"], parts["host"], parts["device"], parts["registration"],
                   services_of(raw.get("services") or {}), raw.get("plan"), parts["cache"],
                   host_name or str(raw.get("host_name") or LOCAL), str(raw.get("hostname") or ""),
                   dict(raw.get("toolchain") or {}), tuple(raw.get("nodes") or ()), tuple(raw.get("history") or ()))


def value_of(cls: type, raw: dict[str, Any]) -> Any:
    """A frozen dataclass from its `asdict` form: unknown keys dropped, lists back to tuples
    where the field is a tuple (a field the sender lacks keeps its default)."""
    kinds = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    values = {}
    for name, kind in kinds.items():
        if name not in raw:
            continue
        value = raw[name]
        if kind.startswith("tuple") and isinstance(value, list):
            value = tuple(value)
        elif kind.startswith("dict") and isinstance(value, dict) and "tuple" in kind:
            value = {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
        values[name] = value
    return cls(**values)


def services_of(raw: dict[str, Any]) -> ServicesSnapshot:
    """ServicesSnapshot.to_json's inverse: each view's record, /health and serving figures."""
    from console.data.services import ServiceView, Serving
    from runtime.serve.contract import Health
    from store.services import Service

    views = []
    for v in raw.get("services") or ():
        detail = Health.from_json(v["detail"]) if v.get("detail") else None
        serving = value_of(Serving, v["serving"]) if v.get("serving") else None
        views.append(ServiceView(Service.from_json(v), str(v.get("health") or ""), detail, str(v.get("problem") or ""),
                                 serving))
    return ServicesSnapshot(tuple(views), str(raw.get("error") or ""))


# ---------------------------------------------------------------------------------------------


def programs_of(plan: dict[str, Any], root: Path) -> ProgramsSnapshot:
    check = [p for p in plan.get("problems", []) if p.startswith(("check:", "plan failed"))]
    return ProgramsSnapshot(str(root), tuple(plan.get("programs", ())), error="; ".join(check))


def next_launch(verdict: dict[str, Any]) -> str:
    """What the next launch does with its sidecar, in words (from the plan's verdict)."""
    if verdict.get("verdict") == MAP:
        return f"{MAP} (cold: reads uncached bytes)" if verdict.get("cold_read") else MAP
    return f"REPACK ({verdict.get('reason') or '?'})"


def sidecars_of(plan: dict[str, Any], model_dir: Path, now: float) -> SidecarsSnapshot:
    """The plan's sidecar (the one the next launch maps or replaces), then any other sidecar
    files beside the checkpoint, listed without a verdict: the next launch does not use them."""
    judged = plan.get("sidecar") or {}
    if not judged:
        return SidecarsSnapshot(str(model_dir), error="; ".join(plan.get("problems", [])) or "no plan")
    defaults = {"verdict": REPACK, "reason": "", "detail": "", "residency": None, "residency_method": None,
                "size_bytes": 0}  # a plan over a broken checkpoint says less: the pane still has every key
    rows = [{**defaults, **judged, "sampled_at": judged.get("sampled_at") or now,
             "next_launch": next_launch(judged), "wanted": True}]
    try:
        others = [p for p in sc.find_sidecars(model_dir) if str(p) != judged.get("path")]
    except OSError:
        others = []
    for p in others:
        rows.append({"path": str(p), "verdict": "-", "reason": "", "detail": "", "residency": None,
                     "size_bytes": _size(p), "sampled_at": None, "wanted": False,
                     "next_launch": f"not used (ranks {sc.ranks_of(p)})"})
    return SidecarsSnapshot(str(model_dir), tuple(rows), disk_free=free_bytes(Path(judged.get("path") or model_dir)))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def predict(spec: LaunchSpec, history: list[dict[str, Any]], plan: dict[str, Any],
            device: DeviceSnapshot) -> RegistrationSnapshot:
    """The plan's path for each phase in words, with the launches it is compared with: only
    launches like it (`runtime.launch.history.comparable`, the plan's own matcher)."""
    like = Likeness.from_json(plan.get("like"))
    alike = comparable(history, like)
    same = [r for r in alike if like.same_paths(r)] if like else []
    warm = [r for r in alike if is_warm(r)]
    pred: dict[str, str] = {}
    problems = plan.get("problems", [])
    check = next((p for p in problems if p.startswith("check:")), "")
    pred["check"] = f"FAIL: {check[6:].strip()}" if check else "contract check"
    counts = Counter(p["state"] for p in plan.get("programs", ()))
    pred["programs"] = " ".join(f"{s} {counts[s]}" for s in Outcome if counts[s]) or "-"
    if plan.get("ready") == "early" and counts:
        pred["programs"] += " (eager until compiled: --ready early)"
    pred["weights"] = next_launch(plan["sidecar"]) if plan.get("sidecar") else "-"
    pred["upload"] = "zero-copy (cpu)" if device.kind == "cpu" else "copy to device"
    kv = plan.get("kv") or {}
    if kv.get("problem"):
        pred["kv"] = f"FAIL: {kv['problem']}"
    elif kv.get("slots") is not None:
        per_rank = [b.get("slots") for b in kv.get("per_rank") or ()]  # the service's slots are their sum
        split = f" ({' + '.join(map(str, per_rank))})" if len(per_rank) > 1 else ""
        pred["kv"] = f"{kv['slots']} slots{split} of {format_size(kv['slot_bytes'])}" + (" each" if split else "")
    else:
        pred["kv"] = kv.get("detail", "-")
    pred["validate"] = "decode check"
    pred["serve"] = "HTTP"
    predicted = dict(plan.get("predicted") or {})
    return RegistrationSnapshot(same[-1] if same else None, min(warm, key=launch_seconds) if warm else None,
                                pred, basis_line(plan.get("basis") or {}, same[-1] if same else None),
                                same[-2] if len(same) > 1 else None, predicted)





def _sample(path: str | None):
    """Residency of a regular file (never blocks on a FIFO), or None."""
    import os
    import stat

    from store import pagecache

    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return pagecache.residency(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except OSError:
        return None
    finally:
        os.close(fd)


class Collectors:
    """Every pane's snapshot for one launch spec; the console calls `snapshot()` off the UI."""

    def __init__(self, spec: LaunchSpec):
        from runtime.launch.hardware import resolve_device
        from runtime.programs.toolchain import stay_torch_free

        stay_torch_free()  # the plan reads program keys: never through torch, never opening a device
        self.spec = spec
        self.device_kind = resolve_device(spec.device)
        self.host = HostCollector()
        self.services = ServicesCollector(Access.of(spec.api_key_file, spec.ca_file))
        self.plans = PlanWatch(spec)
        self._history: list[dict[str, Any]] = []
        self._history_stamp: tuple[int, int] | None = None
        self._toolchain: dict[str, str] | None = None

    def history(self) -> list[dict[str, Any]]:
        """The launch history, re-read only when the file changed (it only grows)."""
        from store.history import history_path, read_history

        try:
            st = history_path().stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            return []
        if stamp != self._history_stamp:
            try:
                self._history = read_history(limit=500)
            except Exception:  # an unreadable history is an empty one here, never a crash
                return []
            self._history_stamp = stamp
        return self._history

    def plan(self) -> tuple[Any, dict[str, Any]]:
        return self.plans.get(self.history())

    def _residency(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """The plan, with its sidecar's residency sampled now (cachestat: every refresh; the
        mincore fallback: on the schedule `store.pagecache.schedule` sets); re-planned when the
        sample moved away from what the plan's verdict was made with."""
        _, plan = self.plans.get(history)
        side = plan.get("sidecar") or {}
        res = _sample(side.get("path"))
        if res is None or side.get("residency") is None:
            return plan
        if abs(res.fraction - side["residency"]) > RESIDENCY_DRIFT:
            self.plans.invalidate()
            _, plan = self.plans.get(history)
            side = plan.get("sidecar") or {}
        return {**plan, "sidecar": {**side, "residency": res.fraction, "residency_method": res.method,
                                    "sampled_at": res.sampled_at}}

    def snapshot(self, with_history: bool = False) -> Snapshot:
        """Every pane's data now; `with_history`: the launch history's last records too."""
        s = self.spec
        now = time.time()
        history = self.history()
        plan = self._residency(history)
        device = collect_device(s, self.device_kind, (plan.get("kv") or {}).get("slot_bytes"))
        settings = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(s).items()}
        settings["device"] = self.device_kind
        return Snapshot(now, settings, programs_of(plan, s.kernel_cache_dir), sidecars_of(plan, s.model, now),
                        self.host(), device, predict(s, history, plan, device), self.services(), plan,
                        self.plans.cache, LOCAL, socket.gethostname(), self.toolchain(), node_views(),
                        tuple(history[-HISTORY_SHIPPED:]) if with_history else ())

    def toolchain(self) -> dict[str, str]:
        """This host's toolchain (read once: it changes only with an install, which restarts us)."""
        if self._toolchain is None:
            from console.data.toolchain import toolchain

            try:
                self._toolchain = toolchain(self.device_kind)
            except Exception as e:  # a collector never takes the console down
                self._toolchain = {"error": f"{type(e).__name__}: {e}"}
        return self._toolchain
