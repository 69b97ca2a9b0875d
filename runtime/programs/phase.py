"""The programs phase: every program HIT (verified load) or compiled in a pool of worker
processes and loaded the moment it publishes, while the rest still compile; with `--ready early`,
missing ones run eager and swap in as they publish."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.events import Emitter, Phase
from runtime.programs.outcome import Outcome
from store.errors import UserError
from store.kernel_cache.trust import check_trust
from store.units import format_size

if TYPE_CHECKING:
    from runtime.programs.pool import Compiled


class CompileFailed(UserError):
    """A program that must be compiled before serving (`--ready compiled`) did not compile."""


def _path_taken(prepared) -> Outcome:
    """HIT, or why not (MISS, STALE: a cached entry of that program was built by another toolchain, …)."""
    if prepared.outcome == "hit":
        return Outcome.HIT
    if prepared.outcome == "eager":
        return Outcome.EAGER
    return Outcome.of_miss(prepared.miss_kind)


@dataclass
class Prepared:
    """The programs phase's result: the runner table, each program's record, and what it cost."""

    runners: Any  # runtime.programs.tiers.TieredRunners (or a dict of eager runners)
    results: list[dict[str, Any]]
    artifact_bytes: int = 0  # bytes of the artifacts loaded (each hashed once, by the plan or a lookup)


def program_record(name: str, outcome: str, seconds: float, backend: str, fingerprint: str | None, reason: str,
                   tier: str, load: tuple[int, float] = (0, 0.0)) -> dict[str, Any]:
    """One program's record in the programs phase's results (what registration and the history read):
    `load` is the bytes its artifact loaded and the seconds that took, this host's load rate."""
    return {"program": name, "outcome": outcome, "tier": tier, "seconds": round(seconds, 4), "backend": backend,
            "fingerprint": fingerprint, "reason": reason, "load_bytes": load[0], "load_s": round(load[1], 4)}


def prepare_programs(plan, emitter: Emitter, *, stop: threading.Event | None = None, load: bool = True,
                     phase: str = Phase.PROGRAMS, only: set[str] | None = None) -> Prepared:
    """Every program of the plan ready to run. The plan's HITs load from the bytes its probe
    verified (`plan.hits`; never read again); the others compile in a pool of worker processes
    (`--jobs`, longest first, within a memory floor), each loading as soon as it publishes — a
    MISS that another process published since the plan was made loads at once. With the plan's
    `ready == "early"` the missing ones run eager meanwhile and swap in as they publish
    (`TieredRunners`); otherwise this returns when all are loaded. `load=False` (`dsv4 compile`)
    only makes sure every program is published (`only`: those programs; another host of the
    service compiles the rest)."""
    from runtime.programs.build import prepare
    from runtime.programs.tiers import COMPILED, EAGER, TieredRunners

    backend, device = plan.backend, plan.device
    specs = list(plan.catalog.specs.values())
    planned = {p.program: p for p in plan.programs}
    results: dict[str, dict[str, Any]] = {}
    loaded_bytes = [0]

    def record(name: str, outcome: Outcome, seconds: float, fingerprint: str | None, reason: str,
               tier: str = COMPILED, load: tuple[int, float] = (0, 0.0)) -> None:
        results[name] = program_record(name, outcome, seconds, backend, fingerprint, reason, tier, load)
        emitter.emit(phase, "progress", done=len(results), total=len(specs), unit="programs", detail=results[name])

    def done(runners) -> Prepared:
        return Prepared(runners, [results[s.name] for s in specs], loaded_bytes[0])

    if backend == "eager":
        runners = {}
        for spec in specs:
            runners[spec.name] = prepare(spec, cache=None, backend="eager", device=device).run
            record(spec.name, Outcome.EAGER, 0.0, None, "eager backend", EAGER)
        return done(runners)
    cache = _trusted_cache(plan)
    hits = dict(plan.hits) if load else {}
    for spec in specs:  # published since the plan was made (another launch, or rank 0 of this one)
        if planned[spec.name].state in (Outcome.MISS, Outcome.STALE):
            found = cache.probe(spec.name, plan.keys[spec.name])
            if found.hit:
                hits[spec.name] = found
    missing = [s for s in specs if planned[s.name].state != Outcome.HIT and s.name not in hits]
    if only is not None:
        specs = [s for s in specs if s.name in only]
        missing = [s for s in missing if s.name in only]
    pool = _pool(plan, cache.root, emitter, phase, stop)
    if not load:
        compiled = _run_pool(pool, missing, emitter, phase) if missing else {}
        for spec in specs:
            result = compiled.get(spec.name)
            _raise_if_failed(spec, result)
            record(spec.name, result.path_taken if result else Outcome.HIT, result.seconds if result else 0.0,
                   planned[spec.name].fingerprint, planned[spec.name].reason if result else "")
        return done(TieredRunners({}, {}))

    def load_one(spec, compiled: Compiled | None = None) -> Callable[..., Any]:
        """A HIT (from its verified bytes), or a program the pool has just published (`compiled`:
        a verified lookup of the entry it wrote)."""
        prepared = _load(spec, cache, backend, device, hits.get(spec.name) if compiled is None else None)
        loaded_bytes[0] += prepared.artifact_bytes
        reason = planned[spec.name].reason if compiled else prepared.reason
        record(spec.name, compiled.path_taken if compiled else _path_taken(prepared),
               prepared.seconds + (compiled.seconds if compiled else 0.0), prepared.fingerprint, reason,
               load=(prepared.artifact_bytes, prepared.seconds))
        return prepared.run

    early = plan.ready == "early" and bool(missing)
    if early:
        runners, tiers = {}, {}
        for spec in specs:
            if spec in missing:
                runners[spec.name], tiers[spec.name] = \
                    prepare(spec, cache=None, backend="eager", device=device).run, EAGER
                record(spec.name, planned[spec.name].state, 0.0, None, planned[spec.name].reason, EAGER)
            else:
                runners[spec.name], tiers[spec.name] = load_one(spec), COMPILED
    else:
        runners = _load_while_compiling(pool, specs, missing, load_one, emitter, phase)
        tiers = dict.fromkeys(runners, COMPILED)
    table = TieredRunners(runners, tiers, on_swap=lambda name: emitter.log(
        phase, f"{name}: compiled tier swapped in", program=name, tier=COMPILED))
    if early:
        threading.Thread(target=_compile_in_background, name="compile-pool", daemon=True,
                         args=(pool, missing, cache, backend, device, table, emitter, phase)).start()
    return done(table)


def _trusted_cache(plan):
    """The plan's kernel cache, once more checked for trust: a root that is not ours (or turned
    untrusted since the plan) is one line before any program is loaded from it."""
    from store.kernel_cache import KernelCache, UntrustedCacheError
    from store.paths import kernel_cache_dir

    if plan.cache is None:
        untrusted = next((p.reason for p in plan.programs if p.state == Outcome.UNTRUSTED), "")
        if untrusted:
            raise UntrustedCacheError(untrusted)
        return KernelCache(kernel_cache_dir(plan.spec.kernel_cache_dir))
    check_trust(plan.cache.layout)
    return plan.cache


def _loader() -> ThreadPoolExecutor:
    """The thread that loads programs, in the order they are handed over, while the pool's thread
    only polls its workers: loads overlap the compiles still running. One is enough: a load is
    mostly Python (the GIL) and the cores are the workers'."""
    return ThreadPoolExecutor(1, thread_name_prefix="program-load")


def _load_while_compiling(pool, specs: list, missing: list, load: Callable[..., Callable[..., Any]],
                          emitter: Emitter, phase: str) -> dict[str, Callable[..., Any]]:
    """--ready compiled: the HITs load at once and each missing program the moment the pool
    publishes it. A failed compile raises once the pool is done (the other compiles still
    publish, for the next launch), a failed load once the loads before it in spec order are
    done; either way loads not started by then are cancelled and the one under way joined."""
    by_name = {s.name: s for s in missing}
    with _loader() as loader:
        loads = {s.name: loader.submit(load, s) for s in specs if s.name not in by_name}

        def published(done: Compiled) -> None:
            if done.ok:
                loads[done.program] = loader.submit(load, by_name[done.program], done)

        try:
            compiled = _run_pool(pool, missing, emitter, phase, published) if missing else {}
            for spec in missing:
                _raise_if_failed(spec, compiled.get(spec.name))
            return {s.name: loads[s.name].result() for s in specs}
        except BaseException:
            loader.shutdown(cancel_futures=True)  # the `with` then joins the load under way
            raise


def _load(spec, cache, backend: str, device_kind: str, hit=None):
    """A verified load: of the HIT's bytes the plan verified (`hit`), else of the published entry
    (`prepare`: one verified lookup); never beside a compile that runs in this process (the pool's
    serial fallback), as torch does not allow the two at once."""
    from runtime.programs.build import load_verified, prepare
    from runtime.programs.pool import IN_PROCESS_TORCH

    with IN_PROCESS_TORCH:
        if hit is not None:
            return load_verified(spec, hit, cache=cache, backend=backend, device=device_kind)
        return prepare(spec, cache=cache, backend=backend, device=device_kind)


def _raise_if_failed(spec, done: Compiled | None) -> None:
    """A program that did not compile ends `--ready compiled` (and `dsv4 compile`): one line."""
    if done is not None and not done.ok:
        memory = f"; host memory available {format_size(_available())}" if "memory" in done.error else ""
        raise CompileFailed(f"programs: {spec.name} failed to compile ({done.error}){memory}")


def _run_pool(pool, missing: list, emitter: Emitter, phase: str,
              on_done: Callable[[Compiled], None] = lambda compiled: None) -> dict:
    """The pool's run (`on_done` hears each result as it ends), then one event with what it cost:
    the sum of compile seconds, the longest, the wall, and the host memory peak against its floor
    (what `dsv4 bench startup` reports)."""
    started = time.perf_counter()
    compiled = pool.run_or_serial(missing, on_done)
    seconds = [c.seconds for c in compiled.values()]
    workers = f"{pool.jobs} worker" + ("s" if pool.jobs != 1 else "")
    emitter.log(phase, f"compiled {len(compiled)} programs with {workers}", pool=True,
                jobs=pool.jobs, compile_seconds_sum=round(sum(seconds), 3),
                longest_s=round(max(seconds, default=0.0), 3), wall_s=round(time.perf_counter() - started, 3),
                peak_host_used=pool.peak_host_used, floor_bytes=pool.floor_bytes,
                peak_rss=max((c.peak_rss for c in compiled.values()), default=0))
    return compiled


def _available() -> int:
    import psutil

    return psutil.virtual_memory().available


def _pool(plan, root: Path, emitter: Emitter, phase: str, stop: threading.Event | None):
    from runtime.programs.pool import CompilePool, default_jobs

    def on_event(program: str, state: str, detail: dict[str, Any]) -> None:
        emitter.log(phase, f"{program}: {state}", program=program, state=state, **detail)

    return CompilePool(root, plan.backend, plan.device, plan.spec.jobs or default_jobs(),
                       on_event=on_event, stop=stop or threading.Event())


def _compile_in_background(pool, missing, cache, backend, device_kind, table, emitter: Emitter, phase: str) -> None:
    """--ready early: each program loaded and staged the moment it publishes, so they swap in one
    by one; a failure leaves it eager, once said."""
    from runtime.programs.after_ready import for_tier_swap

    if not table.compiles_may_start():
        return  # the launch failed: nothing will serve
    by_name = {s.name: s for s in missing}
    settled: set[str] = set()  # staged or said to stay eager (written by the loader thread only)

    def stage(done: Compiled) -> None:
        settled.add(done.program)
        try:
            if not done.ok:
                raise RuntimeError(done.error)
            with for_tier_swap():
                table.stage(done.program, _load(by_name[done.program], cache, backend, device_kind).run)
        except Exception as e:
            _stays_eager(table, done.program, e, emitter, phase)

    # what this thread compiles in process (the pool's serial fallback) and the loader loads is the
    # tier swap's: counted after ready when each program swaps in
    with _loader() as loader, for_tier_swap():
        try:
            _run_pool(pool, missing, emitter, phase, lambda done: loader.submit(stage, done))
        except Exception as e:  # the service keeps serving on the eager tier
            emitter.log(phase, f"background compile stopped: {e}")
    for spec in missing:
        if spec.name not in settled:
            _stays_eager(table, spec.name, "not compiled", emitter, phase)


def _stays_eager(table, name: str, why, emitter: Emitter, phase: str) -> None:
    table.fail(name, str(why))
    emitter.log(phase, f"warning: {name} stays eager for the life of this process: {why}",
                program=name, state="failed")
