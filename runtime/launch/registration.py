"""Registration: checkpoint → prepared programs + packed weights on the device → serving.

Phases: check → (programs ∥ weights) → upload → kv → validate → serve. Each phase emits
start / progress / end events (runtime.events) with its seconds and the path it took, and the
launch is appended to the launch history. Programs and weights are independent until upload,
so they run on two threads; their events interleave, which is how the overlap shows.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.config import load_config, synthetic_preset
from runtime.events import Emitter, Event
from runtime.plan import DEFAULT_MAX_SLOTS
from store import history
from store.errors import UserError
from store.history import history_path, read_history  # noqa: F401 - re-exported
from store.units import format_size


class RegistrationError(UserError):
    """A launch that cannot proceed; the message says which phase and why."""


@dataclass
class LaunchOptions:
    model_dir: Path
    kernel_cache_dir: Path | None = None
    backend: str = "auto"  # aoti | export | eager | auto
    device: str = "auto"
    memory_utilization: float = 0.9
    device_memory: int | None = None
    use_sidecar: bool = True
    cold_policy: str = "auto"
    ranks: int = 1
    max_seq: int = 1024
    max_slots: int = DEFAULT_MAX_SLOTS
    validate_tokens: int = 8
    history: bool = True
    jobs: int | None = None  # compile workers (None: the CPUs this process may use, capped by memory)
    ready: str = "compiled"  # compiled: serve once every program is compiled | early: serve eager meanwhile
    rank_env: Any = None  # runtime.ranks.RankEnv: this process is one rank of `ranks` (None: the only one)
    rendezvous_timeout: float = 60.0  # seconds every rank has to join (and to reach each sync point)

    @property
    def rank(self) -> int:
        return self.rank_env.rank if self.rank_env is not None else 0


@dataclass
class Launched:
    """Everything a running service needs, plus what the launch cost."""

    options: LaunchOptions
    config: Any
    programs: Any
    weights: Any
    engine: Any  # runtime.engine.Engine: every KV slot of the service
    device: Any
    tokenizer: Any
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    validation_tokens: list[int] = field(default_factory=list)
    tiers: Any = None  # runtime.tiers.TieredRunners: each program's tier, "compiling 9/14" for /health
    mapped: Any = None  # the sidecar the weights are views of (cpu MAP): watch it for changes
    failure: str | None = None  # set when the service must stop generating (the service answers 503)
    group: Any = None  # runtime.ranks.Group: the other ranks of this service (None: one rank)
    _closers: list = field(default_factory=list)

    def close(self) -> None:
        """Release device memory and the sidecar mapping; rank 0 of several tells the others to stop."""
        if self.group is not None:
            self.group.stop()
            self.group.close()
            self.group = None
        self.engine = None
        self.weights = None
        for close in self._closers:
            with contextlib.suppress(Exception):
                close()
        self._closers.clear()
        self.device.release()


class _Phases:
    """Start/end bookkeeping shared by every phase; collects the launch-history record."""

    def __init__(self, emitter: Emitter):
        self.emitter = emitter
        self.records: dict[str, dict[str, Any]] = {}
        self.failed = ""  # the phase an error (or an interrupt) ended
        self.group = None  # once joined: each phase a rank starts is posted (a dead rank's last phase)

    @contextlib.contextmanager
    def run(self, phase: str, **start_detail: Any) -> Iterator[dict[str, Any]]:
        detail: dict[str, Any] = {}
        t0 = time.perf_counter()
        if self.group is not None:
            self.group.set_phase(phase)
        self.emitter.emit(phase, "start", detail=start_detail)
        try:
            yield detail
        except BaseException as e:
            seconds = time.perf_counter() - t0
            self.records[phase] = {"seconds": round(seconds, 4), "error": why(e)}
            self.failed = self.failed or phase  # the first to fail (programs ∥ weights both stop)
            self.emitter.emit(phase, "error", seconds=seconds, message=why(e))
            raise
        seconds = time.perf_counter() - t0
        self.records[phase] = {"seconds": round(seconds, 4), **detail}
        self.emitter.emit(phase, "end", seconds=seconds, detail=detail)


def why(e: BaseException) -> str:
    """An error's one line; a signal's is "interrupted" (its own text is empty)."""
    if isinstance(e, KeyboardInterrupt | InterruptedError):
        return "interrupted"
    return str(e) or type(e).__name__


def _size_kv(launched_device, programs, weights, runners, options: LaunchOptions, detail: dict, group=None):
    from runtime.device import OutOfMemory
    from runtime.engine import Engine
    from runtime.model_programs import kv_slot_bytes
    from runtime.plan import kv_budget

    if group is not None:  # every rank uploaded before any measures: one rank's KV is not another's "used"
        group.gather("kv-measure", "", "kv")
    mem = launched_device.memory()
    per_slot = kv_slot_bytes(programs)
    # ranks on one host share its memory on cpu; on accelerators each rank has its own device
    share = options.rank_env.local_world if options.rank_env is not None and launched_device.kind == "cpu" else 1
    kv = kv_budget(mem.to_json(), per_slot, options.memory_utilization, options.max_slots, share)
    budget, want = kv["budget"], kv["slots"]
    if group is not None:  # every rank holds every sequence's KV: the fewest slots any rank fits
        want = min(int(v) for v in group.gather("kv-slots", str(want), "kv"))

    def too_small(why: str) -> RegistrationError:
        return RegistrationError(
            f"kv: {why}: one sequence slot needs {format_size(per_slot)} (max_seq {programs.dims.max_seq}) but "
            f"the budget is {format_size(max(budget, 0))} = total {format_size(mem.total)} × utilization "
            f"{options.memory_utilization} − used {format_size(mem.used)} (free {format_size(mem.free)}); "
            f"free device memory (residual allocations?), raise --memory-utilization or lower --max-seq")

    if want < 1:
        raise too_small("not even one KV slot fits")
    attempts = []
    while want >= 1:
        before = launched_device.allocated
        try:
            engine = Engine(programs, weights, runners, device=str(launched_device.torch_device),
                            allocate=launched_device.allocate, slots=want, group=group)
        except OutOfMemory as e:
            attempts.append({"slots": want, "error": str(e)})  # a partly built engine is garbage now
            launched_device.free_bytes(launched_device.allocated - before)
            want //= 2
            continue
        if group is not None and len(set(group.gather("kv-allocated", str(want), "kv"))) > 1:
            raise RegistrationError(f"kv: rank {group.rank} fit {want} KV slots after halving, the other ranks "
                                    f"a different count; free device memory or lower --max-slots")
        detail.update(slots=want, slot_bytes=per_slot, budget_bytes=budget, total_bytes=mem.total,
                      used_bytes=mem.used, utilization=options.memory_utilization, attempts=attempts,
                      max_seq=programs.dims.max_seq, **({"ranks_sharing_memory": share} if share > 1 else {}))
        return engine
    raise too_small("allocation failed even after halving to one slot")


def validation_prompt(tokenizer) -> list[int]:
    return tokenizer.encode("DeepSeek V4 registration check")


def register(options: LaunchOptions, emitter: Emitter) -> Launched:
    """Run every phase up to (not including) serve. Raises RegistrationError on a failed phase,
    after its error event; the launch history records the failure too."""
    phases = _Phases(emitter)
    started = time.time()
    try:
        launched = _register(options, emitter, phases)
    except BaseException as e:
        if phases.group is not None:  # every other rank stops at once, with this reason
            with contextlib.suppress(Exception):
                phases.group.abort(f"rank {options.rank} failed in {phases.failed or 'check'}: {why(e)}")
        if options.history and options.rank == 0:
            append_history(options, phases.records, started, "error", why(e), extra={"failed_phase": phases.failed})
        raise
    launched.phases = phases.records
    return launched


@dataclass
class _Checked:
    """What the check phase established: the plan and everything the phases below act on."""

    plan: Any
    config: Any
    ckpt: Any
    device: Any
    pack_plan: Any
    programs: Any
    tokenizer: Any
    group: Any = None  # runtime.ranks.Group once the ranks joined


def _register(options: LaunchOptions, emitter: Emitter, phases: _Phases) -> Launched:
    checked = _check(options, phases)
    runners, loaded = _programs_and_weights(options, emitter, phases, checked)
    launched = Launched(options, checked.config, checked.programs, None, None, checked.device, checked.tokenizer)
    launched.tiers, launched.group = runners, checked.group
    launched._closers.append(loaded.close)
    release = getattr(runners, "release_compiles", lambda go: None)  # --ready early: compile once ready
    try:
        _upload(launched, loaded, checked, emitter, phases)
        with phases.run("kv", utilization=options.memory_utilization) as d:
            launched.engine = _size_kv(checked.device, checked.programs, launched.weights, runners, options, d,
                                       checked.group)
        _validate(launched, options, phases)
    except BaseException:
        release(False)
        raise
    release(True)
    return launched


def _check(options: LaunchOptions, phases: _Phases) -> _Checked:
    """The plan of this launch (carried by the check event), the config and tensor contract,
    the device, and the programs: every phase below acts on this plan."""
    from runtime.device import get_device
    from runtime.model_programs import build_programs
    from runtime.pack_plan import PackPlan
    from runtime.plan import plan_for_launch
    from runtime.tensors import expected_tensors
    from runtime.tokenizer import load_tokenizer
    from store.checkpoint import Checkpoint, check_contract

    env = options.rank_env
    ranks = {"rank": env.rank, "ranks": env.world} if env is not None else {}
    with phases.run("check", model=str(options.model_dir), **ranks) as d:
        plan = plan_for_launch(options)
        d["plan"] = plan.to_json()
        for problem in plan.problems:
            if problem.startswith("check:"):  # the kv phase reports its own, with the numbers
                raise RegistrationError(problem)
        config = load_config(options.model_dir)
        ckpt = Checkpoint.open(options.model_dir)
        report = check_contract(ckpt, expected_tensors(config))
        if not report.ok:
            raise RegistrationError(f"check: {options.model_dir} breaks the tensor contract "
                                    f"({len(report.missing)} missing, {len(report.extra)} extra, "
                                    f"{len(report.mismatched)} mismatched); run `dsv4 check` for the list")
        tokenizer, warning = load_tokenizer(options.model_dir, config.vocab_size)  # a broken one: one line
        if warning:
            phases.emitter.log("check", warning)
        device = get_device(plan.device, options.device_memory, env.local_rank if env is not None else 0)
        options.backend = plan.backend
        pack_plan = PackPlan(config, options.ranks)
        programs = build_programs(config, pack_plan, options.max_seq)
        group = None
        if env is not None:
            from runtime.ranks import rendezvous

            group = phases.group = rendezvous(env, plan_parts(plan, options), options.rendezvous_timeout,
                                              device.kind)
            d.update(ranks)
        d.update(tensors=report.checked, device=device.describe(), programs=len(programs.specs),
                 layers=config.summary(), tokenizer=tokenizer.kind)
    return _Checked(plan, config, ckpt, device, pack_plan, programs, tokenizer, group)


def plan_parts(plan, options: LaunchOptions) -> dict[str, Any]:
    """What must be the same on every rank, by part (the rendezvous names the part that differs):
    the checkpoint's key, every program's fingerprint, and the launch settings."""
    from runtime.prepack import sidecar_key
    from store.fingerprint import fingerprint, sha256_hex

    programs = sha256_hex("\n".join(f"{p.program}={p.fingerprint}" for p in plan.programs))
    return {"checkpoint": fingerprint(sidecar_key(options.model_dir, options.ranks)), "programs": programs[:16],
            "ranks": options.ranks, "backend": plan.backend, "device": plan.device, "max_seq": options.max_seq,
            "max_slots": options.max_slots, "memory_utilization": options.memory_utilization,
            "ready": options.ready, "use_sidecar": options.use_sidecar}


def _programs_and_weights(options: LaunchOptions, emitter: Emitter, phases: _Phases, c: _Checked):
    """Programs (HIT or compile) ∥ weights (MAP or REPACK, as the plan says): independent until
    upload, so two threads; their events interleave, which is how the overlap shows."""
    from runtime.pack_plan import EXPERTS
    from runtime.program_prep import prepare_programs
    from runtime.weight_loaders import loader_for

    stop = threading.Event()  # set when the launch is interrupted: compile workers are killed

    def programs_job():
        with phases.run("programs", total=len(c.programs.specs), backend=options.backend) as d:
            if c.group is not None and c.group.rank > 0 and not c.plan.all_hit():
                # rank 0 compiles each missing key once, then this rank HITs; all HIT: load at once
                c.group.wait("programs", [0], "programs", timeout=PROGRAMS_WAIT_S)
            runners, results = prepare_programs(c.programs, options, c.device.kind, emitter, stop=stop)
            if c.group is not None and c.group.rank == 0:
                c.group.post("programs")
            counts = {k: sum(r["outcome"] == k for r in results) for k in ("HIT", "MISS", "STALE", "EAGER")}
            d.update(counts=counts, programs={r["program"]: r["outcome"] for r in results},
                     tiers={r["program"]: r["tier"] for r in results})
        return runners

    def weights_job():
        loader = loader_for(c.plan, options, c.ckpt, c.pack_plan)

        def progress(done: int, total: int, group: str) -> None:
            if stop.is_set():
                raise InterruptedError("weights: interrupted")
            emitter.emit("weights", "progress", done=done, total=total, unit="layers", detail={"group": group})

        with phases.run("weights", sidecar=options.use_sidecar, planned=loader.path) as d:
            if loader.path == "REPACK" and options.use_sidecar:
                s = c.plan.sidecar
                emitter.log("weights", f"sidecar {s.get('path')}: REPACK ({s.get('reason')}): {s.get('detail')}")
            loaded = loader.load(progress, lambda line: emitter.log("weights", line))
            experts = sum(t.nbytes for n, t in loaded.tensors.items() if c.pack_plan.tensors[n].rule.group == EXPERTS)
            total = sum(t.nbytes for t in loaded.tensors.values())
            # what this rank maps: the weights every rank shares, and its own routed experts
            d.update(loaded.detail, bytes=total, shared_bytes=total - experts, expert_bytes=experts)
        return loaded

    with ThreadPoolExecutor(2, thread_name_prefix="register") as pool:
        fut_programs, fut_weights = pool.submit(programs_job), pool.submit(weights_job)
        try:
            return fut_programs.result(), fut_weights.result()
        except BaseException:
            stop.set()  # the other job stops at its next step; the executor then joins both
            raise


PROGRAMS_WAIT_S = 3600.0  # the other ranks wait this long for rank 0's compiles


def _upload(launched: Launched, loaded, c: _Checked, emitter: Emitter, phases: _Phases) -> None:
    """Main weights, then MTP, onto the device (zero-copy on cpu); the host copy is released."""
    from runtime.weights import packed_views

    device, host_tensors = c.device, loaded.tensors
    with phases.run("upload", device=device.describe()) as d:
        main = {n: t for n, t in host_tensors.items() if not n.startswith("mtp.")}
        mtp = {n: t for n, t in host_tensors.items() if n.startswith("mtp.")}
        total = sum(t.nbytes for t in host_tensors.values())
        placed: dict = {}
        offset = 0
        for part, tensors in (("main", main), ("mtp", mtp)):
            def progress(done, _total, part=part, base=offset):
                emitter.emit("upload", "progress", done=base + done, total=total, unit="bytes", detail={"part": part})
            placed.update(device.upload(tensors, progress))
            offset += sum(t.nbytes for t in tensors.values())
        zero_copy = device.kind == "cpu"
        released = 0 if zero_copy else total
        del main, mtp
        loaded.tensors = {}
        if not zero_copy:
            loaded.close()  # device copies made: the host mapping is no longer needed
        elif loaded.mapped is not None:
            launched.mapped = loaded.mapped  # the weights are its pages: the service watches it
        launched.weights = packed_views(c.pack_plan, placed)
        d.update(bytes=total, zero_copy=zero_copy, host_released_bytes=released)


def _validate(launched: Launched, options: LaunchOptions, phases: _Phases) -> None:
    """One prefill, N greedy decode steps and an MTP draft from the prefill's hidden streams:
    every program runs before serving. Ranks other than 0 run the same steps, as rank 0 leads."""
    import torch

    config = launched.config
    group = launched.group
    if group is not None and group.rank > 0:
        from runtime.ranks import follow

        with phases.run("validate", decode_steps=options.validate_tokens) as d:
            follow(launched.engine, group, until="validated")
            d.update(health="ok", followed=True)
        return
    with phases.run("validate", decode_steps=options.validate_tokens) as d:
        engine = launched.engine
        prompt = validation_prompt(launched.tokenizer)
        drafts = []

        def mtp(step) -> None:
            drafts.append(engine.mtp(step.hidden[:-1], torch.tensor(prompt[1:]), 0))

        t0 = time.perf_counter()
        tokens = list(engine.generate(prompt, options.validate_tokens, on_prefill=mtp))
        seconds = time.perf_counter() - t0
        if len(tokens) != options.validate_tokens or any(not 0 <= t < config.vocab_size for t in tokens):
            raise RegistrationError(f"validate: decode produced {tokens}")
        if not bool(drafts[0].isfinite().all()):
            raise RegistrationError("validate: the MTP layer produced non-finite logits")
        engine.reset()
        if group is not None:
            group.lead("validated")
        launched.validation_tokens = tokens
        d.update(health="ok", prefill_tokens=len(prompt), tokens=tokens,
                 decode_tokens_per_s=round(len(tokens) / seconds, 2) if seconds else None)


def append_history(options: LaunchOptions, phases: dict[str, dict[str, Any]], started: float,
                   outcome: str, error: str = "", extra: dict[str, Any] | None = None) -> None:
    """One JSON line per launch (store.history: O_APPEND, concurrent launches never interleave)."""
    preset = synthetic_preset(options.model_dir)
    history.append({
        "v": 1, "started": round(started, 3), "ended": round(time.time(), 3), "host": socket.gethostname(),
        "pid": os.getpid(), "model": str(options.model_dir), "preset": preset, "device": options.device,
        "backend": options.backend, "cache_dir": str(options.kernel_cache_dir or ""),
        "sidecar": options.use_sidecar, "ranks": options.ranks, "outcome": outcome, "error": error,
        "phases": phases, **(extra or {}),
    })


__all__ = ["Event", "LaunchOptions", "Launched", "RegistrationError", "append_history", "read_history", "register"]
