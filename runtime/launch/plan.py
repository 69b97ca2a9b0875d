"""The plan of the next launch: one truth for the console, the CLI and registration.

`make_plan(model_dir, settings)` says, before anything acts, what a launch with these settings
would do: every program's live key, fingerprint and kernel-cache state (HIT, MISS, STALE naming
the changed component, CORRUPT), the sidecar verdict against the *live* source key and packer
(MAP, or REPACK with reason and residency), the KV budget, and the predicted seconds per phase
from the launch history. It imports no torch: program signatures and keys derive from the config,
the pack plan and the project's source files. Registration computes this plan first and acts on
it; `dsv4 plan` prints it; the console renders it; purge deletes only what it calls stale or
corrupt. A plan over broken inputs is still a plan: each part says what is wrong in one line.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from store.errors import UserError
from store.fingerprint import fingerprint

HIT, MISS, STALE, CORRUPT, EAGER, UNTRUSTED = "HIT", "MISS", "STALE", "CORRUPT", "EAGER", "UNTRUSTED"
PHASES = ("check", "programs", "weights", "upload", "kv", "validate")
MISS_PATHS = {"stale": STALE, "corrupt": CORRUPT, "untrusted": UNTRUSTED}  # a cache miss's kind → path


def miss_path(kind: str) -> str:
    """The path a launch takes for a program the cache did not hit, by the miss's kind."""
    return MISS_PATHS.get(kind, MISS)


# KV slots a service asks for (fewer when memory is short): the most sequences one decode step
# batches. Programs take up to MAX_SLOTS (`--max-slots` is bounded by it).
DEFAULT_MAX_SLOTS, MAX_SLOTS = 32, 4096


@dataclass(frozen=True)
class Settings:
    """What a launch is asked to do (the launch options a plan depends on)."""

    backend: str = "auto"  # aoti | export | eager | auto
    device: str = "auto"
    ranks: int = 1
    max_seq: int = 1024
    max_slots: int = DEFAULT_MAX_SLOTS
    kernel_cache_dir: Path | None = None
    use_sidecar: bool = True
    cold_policy: str = "auto"
    memory_utilization: float = 0.9
    device_memory: int | None = None


@dataclass
class ProgramPlan:
    program: str
    state: str  # HIT | MISS | STALE | CORRUPT | UNTRUSTED | EAGER
    fingerprint: str | None
    reason: str = ""
    entry: str | None = None  # the entry a HIT loads, or the corrupt entry a launch would replace


@dataclass
class Plan:
    model: str
    settings: Settings
    device: str = "cpu"
    backend: str = "aoti"
    programs: list[ProgramPlan] = field(default_factory=list)
    sidecar: dict[str, Any] = field(default_factory=dict)
    kv: dict[str, Any] = field(default_factory=dict)
    predicted: dict[str, float | None] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # one line each; a launch would fail on them
    seconds: float = 0.0  # how long making the plan took
    keys: dict[str, Any] = field(default_factory=dict, repr=False)  # program → live Key (not in JSON)

    def states(self) -> dict[str, str]:
        return {p.program: p.state for p in self.programs}

    def all_hit(self) -> bool:
        """No program would compile (every one HIT, or eager)."""
        return all(p.state in (HIT, EAGER) for p in self.programs)

    def weights_path(self) -> str:
        return "MAP" if self.sidecar.get("verdict") == "MAP" else "REPACK"

    def to_json(self) -> dict[str, Any]:
        settings = asdict(self.settings)
        settings["kernel_cache_dir"] = str(self.settings.kernel_cache_dir or "")
        return {
            "model": self.model, "settings": settings, "device": self.device, "backend": self.backend,
            "programs": [asdict(p) for p in self.programs], "sidecar": self.sidecar, "kv": self.kv,
            "predicted": self.predicted, "problems": self.problems, "seconds": round(self.seconds, 4),
        }


def resolve_device(name: str) -> str:
    """`auto` → npu > cuda > cpu, decided without torch (driver device nodes + torch_npu)."""
    if name != "auto":
        return name
    if importlib.util.find_spec("torch_npu") is not None and Path("/dev/davinci0").exists():
        return "npu"
    if Path("/dev/nvidia0").exists() or Path("/dev/nvidiactl").exists():
        return "cuda"
    return "cpu"


def resolve_backend(backend: str, device: str) -> str:
    from runtime.program_spec import default_backend

    return default_backend(device) if backend == "auto" else backend


def model_programs(model_dir: Path | str, settings: Settings, pack_plan=None):
    """The deployment's programs (specs, variants, dims) from config.json alone."""
    from runtime.config import load_config
    from runtime.model_programs import build_programs
    from runtime.pack_plan import PackPlan

    if pack_plan is None:
        config = load_config(model_dir)
        pack_plan = PackPlan(config, settings.ranks)
    return build_programs(pack_plan.config, pack_plan, settings.max_seq)


def program_keys(model_dir: Path | str, settings: Settings) -> dict[str, Any]:
    """Live cache keys of every program this model needs (what `cache ls --model` judges by)."""
    from runtime.program_spec import program_key

    device = resolve_device(settings.device)
    backend = resolve_backend(settings.backend, device)
    if backend == "eager":
        backend = "export"  # eager launches cache nothing; judge entries as the export key
    return {n: program_key(s, backend, device) for n, s in model_programs(model_dir, settings).specs.items()}


def make_plan(model_dir: Path | str, settings: Settings | None = None, *,
              history: list[dict[str, Any]] | None = None) -> Plan:
    """The plan of the next launch of `model_dir` with `settings`. Never raises for bad inputs."""
    started = time.perf_counter()
    settings = settings or Settings()
    plan = Plan(str(model_dir), settings)
    plan.device = resolve_device(settings.device)
    plan.backend = resolve_backend(settings.backend, plan.device)
    programs = layout = None
    try:
        from runtime.config import load_config
        from runtime.pack_plan import PackPlan

        layout = PackPlan(load_config(model_dir), settings.ranks)
        programs = model_programs(model_dir, settings, layout)
    except (UserError, ValueError, OSError) as e:
        plan.problems.append(f"check: {e}")
    if programs is not None:
        plan.programs = _program_states(programs, plan)
        plan.kv = _kv(programs, settings, plan.device)
        if plan.kv.get("problem"):
            plan.problems.append(f"kv: {plan.kv['problem']}")
    plan.sidecar = _sidecar(model_dir, settings, layout)
    if history is None:
        from store.history import read_history

        with contextlib.suppress(OSError, UserError):
            history = read_history()
    plan.predicted = _predict(plan, history or [])
    plan.seconds = time.perf_counter() - started
    return plan


def _program_states(programs, plan: Plan) -> list[ProgramPlan]:
    from runtime.program_spec import program_key
    from store.kernel_cache import KernelCache
    from store.paths import kernel_cache_dir

    if plan.backend == "eager":
        return [ProgramPlan(n, EAGER, None, "eager backend: nothing cached") for n in programs.specs]
    try:
        cache = KernelCache(plan.settings.kernel_cache_dir or kernel_cache_dir())
    except (UserError, OSError) as e:
        return [ProgramPlan(n, UNTRUSTED, None, str(e)) for n in programs.specs]
    out = []
    for name, spec in programs.specs.items():
        key = plan.keys[name] = program_key(spec, plan.backend, plan.device)
        try:
            found = cache.probe(name, key)
        except (UserError, OSError) as e:
            out.append(ProgramPlan(name, UNTRUSTED, fingerprint(key), str(e)))
            continue
        if found.hit:
            out.append(ProgramPlan(name, HIT, found.fingerprint, "", str(found.path)))
            continue
        state = miss_path(found.kind)
        entry = str(cache.base / name / found.fingerprint) if state in (CORRUPT, UNTRUSTED) else None
        out.append(ProgramPlan(name, state, found.fingerprint, found.reason, entry))
    return out


def _sidecar(model_dir: Path | str, settings: Settings, layout) -> dict[str, Any]:
    from runtime.prepack import judge
    from store import sidecar

    path = sidecar.default_sidecar_path(model_dir, settings.ranks)
    if not settings.use_sidecar:
        return {"path": str(path), "verdict": "REPACK", "reason": "disabled", "detail": "--no-sidecar"}
    try:
        if layout is None:
            raise UserError("the checkpoint's config does not load (see check)")
        return judge(model_dir, settings.ranks, cold_policy=settings.cold_policy, plan=layout).to_json()
    except (UserError, ValueError, OSError) as e:
        return {"path": str(path), "verdict": "REPACK", "reason": "source", "detail": str(e)}


def host_memory(cap: int | None = None) -> dict[str, int]:
    """Host memory as the cpu device sees it (total, free, used), capped like --device-memory."""
    import psutil

    vm = psutil.virtual_memory()
    if cap is None:
        return {"total": vm.total, "free": vm.available, "used": vm.total - vm.available}
    free = max(0, min(cap, vm.available))
    return {"total": cap, "free": free, "used": cap - free}


def kv_budget(memory: dict[str, int], slot_bytes: int, utilization: float, max_slots: int,
              share: int = 1) -> dict[str, Any]:
    """budget = (total × utilization − used) / share; slots = what fits, up to max_slots
    (registration's rule). `share`: the ranks of one service that split this memory (cpu)."""
    budget = (int(memory["total"] * utilization) - memory["used"]) // share
    slots = min(max_slots, budget // slot_bytes) if budget > 0 and slot_bytes > 0 else 0
    out: dict[str, Any] = {**memory, "utilization": utilization, "budget": budget,
                           "slot_bytes": slot_bytes, "slots": slots, **({"ranks": share} if share > 1 else {})}
    if slots < 1:
        out["problem"] = (f"not even one KV slot fits: a slot needs {slot_bytes} bytes, the budget is "
                          f"{max(budget, 0)} bytes (total × {utilization} − used)")
    return out


def _kv(programs, settings: Settings, device: str) -> dict[str, Any]:
    from runtime.model_programs import kv_slot_bytes

    slot = kv_slot_bytes(programs)
    if device != "cpu":  # device memory needs the device runtime: registration measures it
        return {"slot_bytes": slot, "slots": None, "max_seq": settings.max_seq,
                "detail": f"{device} memory is measured at launch"}
    # every rank holds every sequence's KV; on one cpu host the ranks split its memory
    return {**kv_budget(host_memory(settings.device_memory), slot, settings.memory_utilization,
                        settings.max_slots, settings.ranks), "max_seq": settings.max_seq}


def _predict(plan: Plan, history: list[dict[str, Any]]) -> dict[str, float | None]:
    """Seconds per phase, from the newest successful launch of this model with as many ranks
    that took the same paths (programs all HIT or not, weights MAP or REPACK); None where none did."""
    mine = [r for r in history if r.get("model") == plan.model and r.get("outcome") == "ok"
            and r.get("ranks", 1) == plan.settings.ranks]
    all_hit = plan.all_hit()
    weights = plan.weights_path()
    out: dict[str, float | None] = {}
    for phase in PHASES:
        value = None
        for record in reversed(mine):
            phases = record.get("phases") or {}
            counts = (phases.get("programs") or {}).get("counts") or {}
            if phase == "programs" and (not counts.get("MISS") and not counts.get("STALE")) != all_hit:
                continue
            if phase == "weights" and (phases.get("weights") or {}).get("path") != weights:
                continue
            seconds = (phases.get(phase) or {}).get("seconds")
            if isinstance(seconds, int | float):
                value = float(seconds)
                break
        out[phase] = value
    if out.get("weights") is None:
        key = "predicted_read_s" if weights == "MAP" else "predicted_pack_s"
        out["weights"] = plan.sidecar.get(key)
    return out


def plan_for_launch(options) -> Plan:
    """The plan of a `LaunchOptions` (registration and `dsv4 serve`)."""
    return make_plan(options.model_dir, settings_of(options))


def settings_of(options) -> Settings:
    return Settings(**{f: getattr(options, f) for f in Settings.__dataclass_fields__ if hasattr(options, f)})

