"""The plan of the next launch: one truth for the console, the CLI and registration.

`make_plan(spec)` says, before anything acts, what a launch of this `LaunchSpec` would do: every
program's live key, fingerprint and kernel-cache state (HIT, MISS, STALE naming the changed
component, CORRUPT, UNTRUSTED, EAGER), the sidecar verdict against the *live* source key and
packed layout (MAP, or REPACK with reason and residency), the KV budget of every rank
(`runtime.launch.budget`), how `--ready auto` resolves, and the predicted seconds per phase from
the launch history. It imports no torch: program signatures and keys derive from the config, the
packed layout and the project's source files. Registration makes this plan first and carries it
through its phases — the config, layout and program specs built here, and the bytes of every HIT
verified here, are the ones the launch uses; `dsv4 plan` prints it; the console renders it; purge
deletes only what it calls stale or corrupt. A plan over broken inputs is still a plan: each part
says what is wrong in one line.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from runtime.events import REGISTRATION, Phase
from runtime.launch import history as records
from runtime.launch.plan_report import (
    CHECK,
    KV,
    KvPlan,
    PlanReport,
    Problem,
    ProgramPlan,
    SidecarPlan,
)
from runtime.launch.spec import LaunchSpec
from runtime.programs.outcome import Outcome
from store.errors import UserError
from store.fingerprint import fingerprint
from store.sidecar.verdict import MAP, REPACK, Reason


@dataclass
class Plan:
    spec: LaunchSpec
    device: str = "cpu"  # resolved (never auto)
    backend: str = "aoti"  # resolved (never auto)
    programs: list[ProgramPlan] = field(default_factory=list)
    sidecar: SidecarPlan | None = None
    kv: KvPlan | None = None
    predicted: dict[str, float | None] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)  # a launch would fail on them
    seconds: float = 0.0  # how long making the plan took
    # What a launch acts on, built once here (never in the JSON):
    config: Any = field(default=None, repr=False)  # runtime.model.config.DeepSeekV4Config
    layout: Any = field(default=None, repr=False)  # runtime.weights.layout.PackedLayout
    catalog: Any = field(default=None, repr=False)  # runtime.programs.catalog.ModelPrograms
    keys: dict[str, Any] = field(default_factory=dict, repr=False)  # program → live Key
    cache: Any = field(default=None, repr=False)  # the KernelCache the states were judged in
    hits: dict[str, Any] = field(default_factory=dict, repr=False)  # program → verified Hit (kept bytes)
    basis: dict[str, str | None] = field(default_factory=dict)  # phase → "history" | "model" | None
    compared: dict[str, Any] | None = None  # the newest like launch (started, pid), or None
    content: dict[str, Any] = field(default_factory=dict)  # the checkpoint's content identity (store.content_id)
    content_id: Any = field(default=None, repr=False)  # store.content_id.ContentId, what the ranks compare
    across_hosts: str = ""  # how a service over several hosts gets its missing programs (runtime.launch.share)
    resolution: Resolution | None = field(default=None, repr=False)  # every `auto`, decided (make_plan)

    @property
    def model(self) -> str:
        return str(self.spec.model)

    def states(self) -> dict[str, Outcome]:
        return {p.program: p.state for p in self.programs}

    def all_hit(self) -> bool:
        """No program would compile (every one HIT, or eager)."""
        return not any(p.state.compiles for p in self.programs)

    def weights_path(self) -> str:
        return MAP if self.sidecar is not None and self.sidecar.mapped else REPACK

    @property
    def config_bytes(self) -> bytes | None:
        """config.json as this launch read it, once (`resolve`)."""
        return self.resolution.config_bytes if self.resolution is not None else None

    @property
    def speculative(self) -> bool:
        """Whether MTP drafts in this launch (`--speculative` resolved)."""
        return self.resolution is not None and self.resolution.speculative

    @property
    def ready(self) -> str:
        """`--ready` as this launch takes it: auto is early when programs would compile and one
        rank serves (early serves one rank only), compiled otherwise."""
        if self.spec.ready != "auto":
            return self.spec.ready
        early = not self.all_hit() and self.spec.ranks == 1 and self.backend != "eager"
        return "early" if early else "compiled"

    def report(self) -> PlanReport:
        """What travels of this plan (`dsv4 plan --json`, the check event, the console's snapshot)."""
        return PlanReport(model=self.model, spec=self.spec, device=self.device, backend=self.backend,
                          ready=self.ready, speculative="mtp" if self.speculative else "off",
                          ranks_here=self.resolution.ranks_here if self.resolution else self.spec.ranks,
                          programs=tuple(self.programs), sidecar=self.sidecar, kv=self.kv,
                          predicted=dict(self.predicted), basis=dict(self.basis), compared=self.compared,
                          like=records.likeness(self), content=dict(self.content), across_hosts=self.across_hosts,
                          problems=tuple(self.problems), seconds=self.seconds)

    def to_json(self) -> dict[str, Any]:
        return self.report().to_json()


def resolve_backend(backend: str, device: str) -> str:
    from runtime.programs.spec import default_backend

    return default_backend(device) if backend == "auto" else backend


def target(spec: LaunchSpec) -> tuple[str, str]:
    """(device, backend) of `spec`, every `auto` decided for this host."""
    from runtime.launch.hardware import resolve_device

    device = resolve_device(spec.device)
    return device, resolve_backend(spec.backend, device)


@dataclass(frozen=True)
class Resolution:
    """Every `auto` of a launch decided once, for this host, with config.json read once (vLLM's
    `create_engine_config()`): the device, the backend, whether MTP drafts, how many of the
    service's ranks run here. The plan makes it first and acts on it; the rank launcher, which
    plans nothing, makes only this; `dsv4 serve` carries out what they decided. `problems`: what
    makes the settings unusable, one sentence each (`check`)."""

    device: str
    backend: str
    speculative: bool
    ranks_here: int  # under torchrun this node's ranks (LOCAL_WORLD_SIZE), else every rank
    config: Any = field(default=None, repr=False)  # runtime.model.config.DeepSeekV4Config; None: it did not load
    config_bytes: bytes | None = field(default=None, repr=False)  # what it was read from: every key hashes these
    problems: tuple[Problem, ...] = ()

    def check(self) -> None:
        """One line (UserError) for the first problem, as `dsv4 serve` says it before starting."""
        if self.problems:
            raise UserError(self.problems[0].text)


def speculation(choice: str, config) -> tuple[bool, str]:
    """`--speculative` → (whether MTP drafts, the problem with asking): auto is on for a real
    checkpoint with an MTP layer, off for a synthetic one (its random MTP weights draft badly)."""
    if choice == "off":
        return False, ""
    has_mtp = config.num_nextn_predict_layers > 0
    if choice == "mtp":
        return has_mtp, "" if has_mtp else (f"--speculative mtp: {config.source} has no MTP layer "
                                           f"(num_nextn_predict_layers 0); use off")
    return has_mtp and config.synthetic is None, ""


def resolve(spec: LaunchSpec, local_ranks: int | None = None) -> Resolution:
    """The `Resolution` of `spec` on this host (`local_ranks`: set under torchrun, where each
    node runs its share of the ranks and each rank checks its own device)."""
    from runtime.launch.hardware import accelerator_count
    from runtime.model.config import read_config

    device, backend = target(spec)
    here = local_ranks or spec.ranks
    problems: list[Problem] = []
    config = data = None
    speculative = False
    try:
        data, config = read_config(spec.model)  # the launch's one read of config.json
        config.check_ranks(spec.ranks)
    except (UserError, ValueError, OSError) as e:
        problems.append(Problem(kind=CHECK, text=str(e)))
    if config is not None:
        speculative, why = speculation(spec.speculative, config)
        if why:
            problems.append(Problem(kind=CHECK, text=why))
    # one rank a device: several ranks need as many devices here (a lone rank's missing device is
    # the device's own error, which says what is missing); under torchrun each rank checks its own
    if device != "cpu" and local_ranks is None and here > 1 and here > (count := accelerator_count(device)):
        problems.append(Problem(kind=CHECK, text=f"--ranks {spec.ranks} but this host has {count} {device} "
                                f"device(s); one rank per device: run at most {count} ranks here (torchrun "
                                f"--nnodes for more hosts)"))
    return Resolution(device, backend, speculative, here, config, data, tuple(problems))


def model_programs(spec: LaunchSpec, layout=None):
    """The deployment's programs (specs, variants, dims) from config.json alone."""
    from runtime.model.config import load_config
    from runtime.programs.catalog import build_programs
    from runtime.weights.layout import PackedLayout

    if layout is None:
        layout = PackedLayout(load_config(spec.model), spec.ranks)
    return build_programs(layout.config, layout, spec.max_seq)


def program_keys(spec: LaunchSpec) -> dict[str, Any]:
    """Live cache keys of every program this model needs (what `cache ls --model` judges by)."""
    from runtime.programs.spec import program_key

    device, backend = target(spec)
    if backend == "eager":
        backend = "export"  # eager launches cache nothing; judge entries as the export key
    return {n: program_key(s, backend, device) for n, s in model_programs(spec).specs.items()}


def make_plan(spec: LaunchSpec, *, history: list[dict[str, Any]] | None = None,
              keep_verified: bool = False, digests: str = "remembered", local_ranks: int | None = None) -> Plan:
    """The plan of the next launch of `spec` (its model resolved). Never raises for bad inputs.
    `keep_verified`: keep each HIT's verified bytes in `plan.hits`, for the launch to load.
    `digests`: "compute" reads every shard whose content digest is not known yet (a launch,
    `dsv4 plan`); "remembered" never reads a shard (the console's refresh must stay cheap).
    `local_ranks`: the ranks of the service that run on this host (default: all of them), whose
    KV its devices hold (a service across hosts: each host sizes its own)."""
    started = time.perf_counter()
    plan = Plan(spec)
    plan.resolution = r = resolve(spec, local_ranks)
    plan.device, plan.backend, plan.config = r.device, r.backend, r.config
    plan.problems.extend(r.problems)
    try:
        if plan.config is not None:
            from runtime.weights.layout import PackedLayout

            plan.layout = PackedLayout(plan.config, spec.ranks)
            plan.catalog = model_programs(spec, plan.layout)
    except (UserError, ValueError, OSError) as e:
        if not r.problems:  # the ranks the experts do not divide is said once, by the resolution
            plan.problems.append(Problem(kind=CHECK, text=str(e)))
    if plan.catalog is not None:
        plan.programs = judge_programs(plan, keep_verified)
        plan.kv = _kv(plan, r.ranks_here)
        if plan.kv.problem:
            plan.problems.append(Problem(kind=KV, text=plan.kv.problem))
        plan.content = _content(plan, compute=digests == "compute")
        if plan.backend != "eager":
            from runtime.launch.share import Keys

            plan.across_hosts = Keys.of(spec).line()
    plan.sidecar = _sidecar(plan)
    if history is None:
        from store.history import read_history

        with contextlib.suppress(OSError, UserError):
            history = read_history()
    plan.predicted = predict_seconds(plan, history or [])
    plan.seconds = time.perf_counter() - started
    return plan


def judge_programs(plan: Plan, keep_verified: bool) -> list[ProgramPlan]:
    """Each program of `plan.catalog` in the plan's kernel cache: its live key (`plan.keys`) and
    state, probed with full verification (same-size corruption is CORRUPT here); `keep_verified`
    keeps every HIT's verified bytes (`plan.hits`) for the launch to load."""
    from runtime.programs.spec import program_key
    from store.kernel_cache import KernelCache
    from store.paths import kernel_cache_dir

    specs = plan.catalog.specs
    if plan.backend == "eager":
        return [ProgramPlan(program=n, state=Outcome.EAGER, reason="eager backend: nothing cached") for n in specs]
    try:
        plan.cache = KernelCache(kernel_cache_dir(plan.spec.kernel_cache_dir))
    except (UserError, OSError) as e:
        return [ProgramPlan(program=n, state=Outcome.UNTRUSTED, reason=str(e)) for n in specs]
    out = []
    for name, spec in specs.items():
        key = plan.keys[name] = program_key(spec, plan.backend, plan.device)
        try:
            found = plan.cache.probe(name, key)
        except (UserError, OSError) as e:
            out.append(ProgramPlan(program=name, state=Outcome.UNTRUSTED, fingerprint=fingerprint(key), reason=str(e)))
            continue
        if found.hit:
            out.append(ProgramPlan(program=name, state=Outcome.HIT, fingerprint=found.fingerprint,
                                   entry=str(found.path), size_bytes=sum(f.size for f in found.manifest.files)))
            if keep_verified:
                plan.hits[name] = found
            continue
        state = Outcome.of_miss(found.kind)
        entry = str(plan.cache.layout.base / name / found.fingerprint) \
            if state in (Outcome.CORRUPT, Outcome.UNTRUSTED) else None
        out.append(ProgramPlan(program=name, state=state, fingerprint=found.fingerprint, reason=found.reason,
                               entry=entry))
    return out


def _content(plan: Plan, compute: bool) -> dict[str, Any]:
    """The checkpoint's content identity, each shard's digest and how it was obtained."""
    from store.content_id import content_id

    try:
        plan.content_id = content_id(plan.spec.model, compute=compute, config=plan.config_bytes)
    except (UserError, OSError) as e:
        plan.problems.append(Problem(kind=CHECK, text=str(e)))
        return {"identity": None, "problem": str(e)}
    return plan.content_id.to_json()


def _sidecar(plan: Plan) -> SidecarPlan:
    """The sidecar's verdict, and what a prepack of it writes (`expected_bytes`, beside the
    checkpoint's `checkpoint_bytes` and the disk's `free_bytes`)."""
    from runtime.weights.prepack import judge, sidecar_key, sidecar_size
    from store import sidecar
    from store.sidecar.verdict import repack

    spec = plan.spec
    path = sidecar.default_sidecar_path(spec.model, spec.ranks)
    size = None
    key = None
    if plan.layout is not None:
        with contextlib.suppress(UserError, ValueError, OSError):
            key = sidecar_key(spec.model, spec.ranks, plan.config_bytes)  # once: the verdict and the size share it
            size = sidecar_size(spec.model, spec.ranks, path, plan.layout, key)
    if not spec.use_sidecar:
        return SidecarPlan.of(repack(path, Reason.DISABLED, "--no-sidecar"), size)
    try:
        if plan.layout is None:
            raise UserError("the checkpoint's config does not load (see check)")
        verdict = judge(spec.model, spec.ranks, cold_policy=spec.cold_policy, packed=plan.layout, key=key)
        return SidecarPlan.of(verdict, size)
    except (UserError, ValueError, OSError) as e:
        return SidecarPlan.of(repack(path, Reason.SOURCE, str(e)), size)


def _kv(plan: Plan, ranks: int) -> KvPlan:
    """The KV budget of each of the `ranks` that run on this host's devices, read now
    (runtime.launch.budget)."""
    from runtime.launch.budget import launch_kv
    from runtime.launch.hardware import read_memory
    from runtime.programs.catalog import kv_slot_bytes

    spec = plan.spec
    slot = kv_slot_bytes(plan.catalog)
    reading = read_memory(plan.device, spec.device_memory)
    if reading.error:
        return KvPlan(slot_bytes=slot, max_seq=spec.max_seq, max_slots=spec.max_slots, ranks=ranks,
                      detail=f"{reading.error}; the launch measures it")
    kv = launch_kv(plan.device, reading.devices, ranks, slot, spec.memory_utilization, spec.max_slots,
                   spec.max_seq, spec.device_memory)
    return KvPlan.of(kv, reading.source)


def predict_seconds(plan: Plan, history: list[dict[str, Any]]) -> dict[str, float | None]:
    """Seconds per phase (and `plan.basis`: where each figure comes from). From the newest launch
    like this one (`runtime.launch.history.comparable`: same settings, same path through the
    phase); where there is none, from a model of the phase's cost — the compile seconds the
    kernel cache's manifests record for the programs to compile, the sidecar's read or pack
    time — and None where nothing can say. Never from an unlike launch."""
    like = records.likeness(plan)
    out: dict[str, float | None] = {}
    for phase in REGISTRATION:
        value, basis = None, None
        for record in reversed(records.comparable(history, like, phase)):
            seconds = ((record.get("phases") or {}).get(phase) or {}).get("seconds")
            if isinstance(seconds, int | float):
                value, basis = float(seconds), "history"
                break
        if value is None:
            value = _modelled(plan, phase, history)
            basis = "model" if value is not None else None
        out[phase], plan.basis[phase] = value, basis
    same = [r for r in records.comparable(history, like) if like.same_paths(r)]
    plan.compared = {"started": same[-1].get("started"), "pid": same[-1].get("pid")} if same else None
    return out


def load_rate(history: list[dict[str, Any]], backend: str, device: str) -> float | None:
    """Bytes per second this host loaded programs of `backend` on `device` at, in the newest
    launch that loaded any (whatever its model: loading is reading and linking artifacts)."""
    for record in reversed(history):
        programs = (record.get("phases") or {}).get("programs") or {}
        if record.get("backend") != backend or record.get("device") != device:
            continue
        nbytes, seconds = programs.get("load_bytes"), programs.get("load_s")
        if isinstance(nbytes, int | float) and isinstance(seconds, int | float) and nbytes > 0 and seconds > 0:
            return nbytes / seconds
    return None


def _modelled(plan: Plan, phase: str, history: list[dict[str, Any]]) -> float | None:
    """A phase's seconds from what it will do, without a like launch: compiles by the seconds
    their programs' last manifests record, spread over the pool's workers; loading every HIT by
    its artifact bytes at this host's measured load rate; the weights by the sidecar verdict's
    read (MAP: the sidecar's bytes at the read rate) or pack estimate."""
    if phase == Phase.WEIGHTS:
        if plan.sidecar is None:
            return None
        return plan.sidecar.predicted_read_s if plan.sidecar.mapped else plan.sidecar.predicted_pack_s
    if phase == Phase.PROGRAMS and plan.programs and plan.all_hit():
        rate = load_rate(history, plan.backend, plan.device)
        return None if rate is None else sum(p.size_bytes for p in plan.programs) / rate
    if phase != Phase.PROGRAMS or plan.cache is None or plan.all_hit():
        return None
    from runtime.programs.pool import compile_history, default_jobs

    compiling = [p.program for p in plan.programs if p.state.compiles]
    known = compile_history(plan.cache.root, compiling)
    if len(known) < len(compiling):
        return None  # a program never compiled here: no figure beats a guess
    seconds = [known[name][0] for name in compiling]
    return max(max(seconds), sum(seconds) / (plan.spec.jobs or default_jobs()))
