"""Registration: checkpoint → prepared programs + packed weights on the device → serving.

Phases: check → (programs ∥ weights) → upload → kv → validate → serve. The check phase makes
the plan of this launch (`runtime.launch.plan`, carried by its start event's detail) and every
phase below acts on it: its config, packed layout and program specs are the launch's, the
programs it verified as HIT load from the bytes it hashed, the weights MAP or REPACK as its
sidecar verdict says, and the KV phase applies its budget rule to the memory the device has
then. Each phase emits start / progress / end events (runtime.events) with its seconds and the
path it took, and the launch is appended to the launch history. Programs and weights are
independent until upload, so they run on two threads; their events interleave, which is how
the overlap shows.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from runtime.events import Emitter, Phase
from runtime.launch import history
from runtime.launch.launched import Launched
from runtime.launch.phases import PhaseRecorder, RegistrationError, why
from runtime.launch.plan_report import CHECK
from runtime.launch.spec import LaunchSpec
from store.sidecar import REPACK
from store.units import format_size


def validation_prompt(tokenizer) -> list[int]:
    return tokenizer.encode("DeepSeek V4 registration check")


def register(spec: LaunchSpec, emitter: Emitter, *, rank_env=None, record: bool = True, on_hosts=None) -> Launched:
    """Run every phase up to (not including) serve for `spec` (its model resolved). `rank_env`
    (runtime.launch.rank_store.RankEnv): this process is one rank of `spec.ranks`. Raises
    RegistrationError on a failed phase, after its error event; the launch history records the
    failure too (`record`: rank 0 of a launch records it). Rank 0 of several watches every
    host's phase and progress until it is done (runtime.launch.progress): events whenever a
    host's phase or the slowest host changes, and every pass told to `on_hosts(ranks, hosts,
    slowest)` (what its /health says meanwhile)."""
    phases = PhaseRecorder(emitter)
    started, t0 = time.time(), time.perf_counter()
    rank = rank_env.rank if rank_env is not None else 0
    watch: list = []
    try:
        launched = _register(spec, rank_env, emitter, phases, lambda group: watch.append(_watch_hosts(
            group, phases.emitter, on_hosts)))
    except BaseException as e:
        if phases.group is not None:  # every other rank stops at once, with this reason
            with contextlib.suppress(Exception):
                line = f"{phases.group.who(rank)} failed in {phases.failed or 'check'}: {why(e)}"
                phases.group.blame(rank, line)
                phases.group.abort(line)
        if record and rank == 0:
            device, backend = resolved(spec, phases.plan)
            history.append(spec, phases.records, started, "error", why(e), device=device, backend=backend,
                           predicted=phases.plan.predicted if phases.plan is not None else None,
                           config=phases.plan.config if phases.plan is not None else None,
                           extra={"failed_phase": phases.failed,
                                  **({"hosts": list(phases.group.hosts)} if phases.group is not None else {})})
        raise
    finally:
        for w in watch:
            w.stop()
    launched.phases = phases.records
    launched.registration_seconds = round(time.perf_counter() - t0, 4)
    if launched.group is not None:  # rank 0 records the slowest rank's seconds of each phase
        with contextlib.suppress(Exception):
            launched.group.post_phase_seconds(phases.records)
    return launched


def _watch_hosts(group, emitter: Emitter, on_hosts):
    def emit(message: str, detail: dict[str, Any]) -> None:
        emitter.emit(group.phase or Phase.CHECK, "log", message=message, detail=detail)

    return group.watch_hosts(on_hosts, emit)


def resolved(spec: LaunchSpec, plan=None) -> tuple[str, str]:
    """(device, backend) as the launch takes them: the plan's, or decided now if none was made."""
    if plan is not None:
        return plan.device, plan.backend
    from runtime.launch.plan import target

    return target(spec)


@dataclass
class _Checked:
    """What the check phase established besides the plan: what the phases below read from."""

    ckpt: Any
    device: Any
    tokenizer: Any
    group: Any = None  # runtime.launch.ranks.Group once the ranks joined
    rank: int = 0


def _register(spec: LaunchSpec, rank_env, emitter: Emitter, phases: PhaseRecorder, watch) -> Launched:
    plan, checked = _check(spec, rank_env, phases, watch)
    runners, loaded = _programs_and_weights(plan, checked, emitter, phases)
    launched = Launched(plan, None, None, checked.device, checked.tokenizer)
    launched.tiers, launched.group = runners, checked.group
    launched.hosts = tuple(checked.group.hosts) if checked.group is not None else ()
    launched._closers.append(loaded.close)
    release = getattr(runners, "release_compiles", lambda go: None)  # --ready early: compile once ready
    try:
        _upload(launched, loaded, checked, emitter, phases)
        with phases.run(Phase.KV, utilization=spec.memory_utilization) as d:
            launched.engine = _size_kv(launched, runners, rank_env, d, phases.emitter)
        _validate(launched, phases)
    except BaseException:
        release(False)
        raise
    release(True)
    from runtime.programs.after_ready import arm

    launched.after_ready = arm(runners, spec.compile_after_ready,
                               lambda message, **detail: emitter.log(Phase.SERVE, message, **detail))
    launched._closers.append(launched.after_ready.disarm)
    return launched


def _check(spec: LaunchSpec, rank_env, phases: PhaseRecorder, watch):
    """The plan of this launch (carried by the check event), the tensor contract, the
    tokenizer, the device, and the ranks joined (rank 0 then `watch(group)`es them): every phase
    below acts on this plan."""
    from runtime.torch_import import import_torch

    import_torch()  # first, before any module that imports torch (runtime.torch_import says why)
    from runtime.launch.device import get_device
    from runtime.launch.plan import make_plan
    from runtime.model.tensors import expected_tensors
    from runtime.model.tokenizer import load_tokenizer
    from store.checkpoint import Checkpoint, check_contract

    ranks = {"rank": rank_env.rank, "ranks": rank_env.world} if rank_env is not None else {}
    with phases.run(Phase.CHECK, model=str(spec.model), **ranks) as d:
        # the content identity is what ranks compare: one process alone never reads its whole
        # checkpoint for it (160 GB at V4 scale), it names it by the digests it remembers
        plan = phases.plan = make_plan(spec, keep_verified=True,
                                       digests="compute" if rank_env is not None else "remembered",
                                       local_ranks=rank_env.local_world if rank_env is not None else None)
        report = plan.report()
        d["plan"] = report.to_json()
        if (problem := report.problem(CHECK)) is not None:  # the kv phase reports its own, with the numbers
            raise RegistrationError(problem.line())
        ckpt = Checkpoint.open(spec.model, config=plan.config_bytes)
        report = check_contract(ckpt, expected_tensors(plan.config))
        if not report.ok:
            raise RegistrationError(f"check: {spec.model} breaks the tensor contract "
                                    f"({len(report.missing)} missing, {len(report.extra)} extra, "
                                    f"{len(report.mismatched)} mismatched); run `dsv4 check` for the list")
        tokenizer, warning = load_tokenizer(spec.model, plan.config.vocab_size)  # a broken one: one line
        if warning:
            phases.emitter.log(Phase.CHECK, warning)
        device = get_device(plan.device, spec.device_memory, rank_env.local_rank if rank_env is not None else 0)
        group = None
        if rank_env is not None:
            from runtime.launch.agree import Join, plan_parts
            from runtime.launch.ranks import rendezvous

            join = Join.of(plan_parts(plan), plan.content_id)
            group = phases.group = rendezvous(rank_env, join, spec.rendezvous_timeout, device.kind, spec.rank_timeout)
            phases.emitter.sinks.append(group.progress_sink)  # what the ranks waiting for this one read
            if rank_env.rank == 0:
                watch(group)
            d.update(ranks, store=rank_env.store_host)
        d.update(tensors=report.checked, device=device.describe(), programs=len(plan.catalog.specs),
                 layers=plan.config.summary(), tokenizer=tokenizer.kind)
    return plan, _Checked(ckpt, device, tokenizer, group, rank_env.rank if rank_env is not None else 0)


def _programs_and_weights(plan, c: _Checked, emitter: Emitter, phases: PhaseRecorder):
    """Programs (HIT or compile) ∥ weights (MAP or REPACK, as the plan says): independent until
    upload, so two threads; their events interleave, which is how the overlap shows."""
    from runtime.programs.outcome import counts
    from runtime.programs.phase import prepare_programs
    from runtime.weights.layout import EXPERTS
    from runtime.weights.loaders import loader_for

    stop = threading.Event()  # set when the launch is interrupted: compile workers are killed
    spec = plan.spec

    def programs_job():
        with phases.run(Phase.PROGRAMS, total=len(plan.catalog.specs), backend=plan.backend) as d:
            across = c.group is not None and plan.backend != "eager"
            if across:  # each host's leader compiles (its share) or receives; its other ranks then HIT
                from runtime.launch import share

                d.update(share.before_programs(plan, c.group, emitter, spec.stall_timeout, lambda only: (
                    prepare_programs(plan, emitter, stop=stop, load=False, only=only))))
            prepared = prepare_programs(plan, emitter, stop=stop)
            if across:
                share.after_programs(c.group)
            results = prepared.results
            # verified = every artifact byte this launch hashed, its plan's probes included: each
            # HIT is hashed once, so on a hot launch it equals the bytes loaded
            d.update(counts=counts(r["outcome"] for r in results),
                     programs={r["program"]: r["outcome"] for r in results},
                     tiers={r["program"]: r["tier"] for r in results},
                     verified_bytes=plan.cache.verified_bytes if plan.cache is not None else 0,
                     artifact_bytes=prepared.artifact_bytes,
                     # what loading (not compiling) took: the rate a later all-HIT launch is predicted by
                     load_s=round(sum(r.get("load_s", 0.0) for r in results), 4),
                     load_bytes=sum(r.get("load_bytes", 0) for r in results))
        return prepared.runners

    def weights_job():
        loader = loader_for(plan, c.ckpt, c.rank)

        def progress(done: int, total: int, group: str) -> None:
            if stop.is_set():
                raise InterruptedError("weights: interrupted")
            emitter.emit(Phase.WEIGHTS, "progress", done=done, total=total, unit="layers", detail={"group": group})

        with phases.run(Phase.WEIGHTS, sidecar=spec.use_sidecar, planned=loader.path) as d:
            if loader.path == REPACK and spec.use_sidecar:
                s = plan.sidecar
                emitter.log(Phase.WEIGHTS, f"sidecar {s.path}: REPACK ({s.reason}): {s.detail}")
            loaded = loader.load(progress, lambda line: emitter.log(Phase.WEIGHTS, line))
            experts = sum(t.nbytes for n, t in loaded.tensors.items() if plan.layout.tensors[n].rule.group == EXPERTS)
            total = sum(t.nbytes for t in loaded.tensors.values())
            # what this rank maps: the weights every rank shares, and its own routed experts
            d.update(loaded.detail, bytes=total, shared_bytes=total - experts, expert_bytes=experts)
        return loaded

    with ThreadPoolExecutor(2, thread_name_prefix="register") as pool:
        # the submits inside the try: a signal while the second thread starts (the programs job
        # may be compiling by then) must stop the first too, or the launch ends after its compiles
        # with no phase to blame
        try:
            fut_programs = pool.submit(programs_job)
            fut_weights = pool.submit(weights_job)
            return fut_programs.result(), fut_weights.result()
        except BaseException:
            stop.set()  # the other job stops at its next step; the executor then joins both
            raise


def _upload(launched: Launched, loaded, c: _Checked, emitter: Emitter, phases: PhaseRecorder) -> None:
    """Main weights, then MTP, onto the device (zero-copy on cpu); the host copy is released."""
    from runtime.weights.views import packed_views

    device, host_tensors = c.device, loaded.tensors
    with phases.run(Phase.UPLOAD, device=device.describe()) as d:
        main = {n: t for n, t in host_tensors.items() if not n.startswith("mtp.")}
        mtp = {n: t for n, t in host_tensors.items() if n.startswith("mtp.")}
        total = sum(t.nbytes for t in host_tensors.values())
        placed: dict = {}
        offset = 0
        for part, tensors in (("main", main), ("mtp", mtp)):
            def progress(done, _total, part=part, base=offset):
                emitter.emit(Phase.UPLOAD, "progress", done=base + done, total=total, unit="bytes",
                             detail={"part": part})
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
        launched.weights = packed_views(launched.plan.layout, placed)
        d.update(bytes=total, zero_copy=zero_copy, host_released_bytes=released)


def _size_kv(launched: Launched, runners, rank_env, detail: dict, emitter: Emitter):
    """As many KV slots as the budget holds (runtime.launch.budget, the plan's rule) on the memory
    this device has now, halving on an allocation that fails."""
    from runtime.engine.engine import Engine
    from runtime.launch.budget import kv_budget, kv_share
    from runtime.launch.device import OutOfMemory
    from runtime.programs.calls import engine_runners
    from runtime.programs.catalog import kv_slot_bytes
    from runtime.programs.spec import fuses

    spec, device, group, programs = launched.spec, launched.device, launched.group, launched.programs
    if group is not None:  # every rank uploaded before any measures: one rank's KV is not another's "used"
        group.gather("kv-measure", "", "kv", stall=spec.stall_timeout,
                     shown=lambda line: emitter.log(Phase.KV, line))
    # blocks the allocator kept from the upload are free memory, not residual use
    device.trim()
    mem = device.memory()
    per_slot = kv_slot_bytes(programs)
    share = kv_share(device.kind, rank_env.local_world if rank_env is not None else 1, spec.device_memory)
    kv = kv_budget(mem, per_slot, spec.memory_utilization, spec.max_slots, share)
    want = kv.slots  # this rank's own: each rank holds only its sequences' KV

    def too_small(why: str) -> RegistrationError:
        return RegistrationError(
            f"kv: {why}: one sequence slot needs {format_size(per_slot)} (max_seq {programs.dims.max_seq}) but "
            f"the budget is {format_size(max(kv.budget, 0))} = total {format_size(mem.total)} × utilization "
            f"{spec.memory_utilization} − used {format_size(mem.used)} (free {format_size(mem.free)}); "
            f"free device memory (residual allocations?), raise --memory-utilization or lower --max-seq")

    problem = too_small("not even one KV slot fits") if want < 1 else None
    if group is not None:  # a rank that cannot hold one slot stops every rank, named
        verdicts = group.gather("kv-fits", str(problem or ""), "kv")
        if problem is None and (first := next(((r, v) for r, v in enumerate(verdicts) if v), None)):
            raise RegistrationError(f"kv: {group.who(first[0])}: {first[1].removeprefix('kv: ')}")
    if problem is not None:
        raise problem
    attempts = []
    # the layers' and experts' calls over the programs
    calls = engine_runners(programs, runners, fuses(launched.plan.backend))
    while want >= 1:
        before = device.allocated
        try:
            engine = Engine(programs, launched.weights, calls, device=str(device.torch_device),
                            allocate=device.allocate, slots=want, group=group)
        except OutOfMemory as e:
            attempts.append({"slots": want, "error": str(e)})  # a partly built engine is garbage now
            device.free_bytes(device.allocated - before)
            device.trim()
            want //= 2
            continue
        rank_slots = [want]
        if group is not None:  # every rank's slots: the global slot ids the scheduler places sequences on
            rank_slots = [int(v) for v in group.gather("kv-allocated", str(want), "kv")]
            engine.place(rank_slots)
        detail.update(slots=want, fits=kv.fits, max_slots=spec.max_slots, slot_bytes=per_slot,
                      budget_bytes=kv.budget, total_bytes=mem.total, used_bytes=mem.used,
                      utilization=spec.memory_utilization, attempts=attempts, max_seq=programs.dims.max_seq,
                      **({"rank_slots": rank_slots, "total_slots": sum(rank_slots)} if group is not None else {}),
                      **({"ranks_sharing_memory": share} if share > 1 else {}))
        return engine
    raise too_small("allocation failed even after halving to one slot")


def _validate(launched: Launched, phases: PhaseRecorder) -> None:
    """One prefill, N greedy decode steps and an MTP draft from the prefill's hidden streams:
    every program runs before serving. Ranks other than 0 run the same steps, as rank 0 leads,
    then the prompt again on a slot of each of them: every rank's tokens must be rank 0's."""
    import torch

    steps = launched.spec.validate_tokens
    group = launched.group
    if group is not None and group.rank > 0:
        from runtime.launch.ranks import follow

        with phases.run(Phase.VALIDATE, decode_steps=steps) as d:
            follow(launched.engine, group, until="validated")
            d.update(health="ok", followed=True)
        return
    with phases.run(Phase.VALIDATE, decode_steps=steps) as d:
        engine = launched.engine
        prompt = validation_prompt(launched.tokenizer)
        drafts = []

        def mtp(step) -> None:
            drafts.append(engine.mtp(step.hidden[:-1], torch.tensor(prompt[1:]), 0))

        t0 = time.perf_counter()
        tokens = list(engine.generate(prompt, steps, on_prefill=mtp))
        seconds = time.perf_counter() - t0
        if len(tokens) != steps or any(not 0 <= t < launched.config.vocab_size for t in tokens):
            raise RegistrationError(f"validate: decode produced {tokens}")
        if not bool(drafts[0].isfinite().all()):
            raise RegistrationError("validate: the MTP layer produced non-finite logits")
        engine.reset()
        for rank in range(1, len(engine.rank_slots)):  # each rank's attention, on a slot of its own
            slot = engine.owner.index(rank)
            theirs = list(engine.generate(prompt, steps, slot=slot))
            engine.reset(slot)
            if theirs != tokens:
                who = group.who(rank) if group is not None else f"rank {rank}"
                raise RegistrationError(f"validate: {who} decoded {theirs} where rank 0 decoded {tokens} "
                                        f"from the same prompt; its weights or programs differ")
        if group is not None:
            group.lead("validated")
        launched.validation_tokens = tokens
        d.update(health="ok", prefill_tokens=len(prompt), tokens=tokens,
                 decode_tokens_per_s=round(len(tokens) / seconds, 2) if seconds else None)
