"""The programs phase: every program HIT (verified load) or compiled in a pool of worker
processes and loaded; with `--ready early`, missing ones run eager and swap in as they publish."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from runtime.events import Emitter
from runtime.plan import miss_path
from store.errors import UserError
from store.units import format_size


class CompileFailed(UserError):
    """A program that must be compiled before serving (`--ready compiled`) did not compile."""


def _path_taken(prepared) -> str:
    """HIT, or MISS / STALE (a cached entry of that program was built by another toolchain)."""
    if prepared.outcome == "hit":
        return "HIT"
    if prepared.outcome == "eager":
        return "EAGER"
    return miss_path(prepared.miss_kind)


def prepare_programs(programs, options, device_kind: str, emitter: Emitter,
                     phase: str = "programs", stop: threading.Event | None = None, load: bool = True):
    """Every program ready to run: HITs load (verified); missing ones compile in a pool of worker
    processes (`options.jobs`, longest first, within a memory floor) and then load. With
    `options.ready == "early"` the missing ones run eager meanwhile and swap in as they publish
    (`TieredRunners`); otherwise this returns when all are compiled. `load=False` (`dsv4
    compile`) only makes sure every program is published. Returns (runners, results)."""
    from runtime.program_spec import program_key
    from runtime.programs import prepare
    from runtime.tiers import COMPILED, EAGER, TieredRunners
    from store.kernel_cache import KernelCache
    from store.paths import kernel_cache_dir

    backend, specs = options.backend, list(programs.specs.values())
    results: dict[str, dict[str, Any]] = {}

    def record(name: str, outcome: str, seconds: float, fingerprint: str | None, reason: str,
               tier: str = COMPILED) -> None:
        results[name] = {"program": name, "outcome": outcome, "tier": tier, "seconds": round(seconds, 4),
                         "backend": backend, "fingerprint": fingerprint, "reason": reason}
        emitter.emit(phase, "progress", done=len(results), total=len(specs), unit="programs", detail=results[name])

    if backend == "eager":
        runners = {}
        for spec in specs:
            runners[spec.name] = prepare(spec, cache=None, backend="eager", device=device_kind).run
            record(spec.name, "EAGER", 0.0, None, "eager backend", EAGER)
        return runners, [results[s.name] for s in specs]
    cache = KernelCache(options.kernel_cache_dir or kernel_cache_dir())
    probes = {s.name: cache.probe(s.name, program_key(s, backend, device_kind)) for s in specs}
    missing = [s for s in specs if not probes[s.name].hit]
    pool = _pool(options, cache.root, device_kind, emitter, phase, stop)
    early = load and options.ready == "early" and bool(missing)
    compiled = {} if early or not missing else _run_pool(pool, missing, emitter, phase)
    runners, tiers = {}, {}
    for spec in specs:
        done = compiled.get(spec.name)
        if spec in missing and early:
            runners[spec.name], tiers[spec.name] = prepare(spec, cache=None, backend="eager", device=device_kind).run, EAGER
            record(spec.name, miss_path(probes[spec.name].kind), 0.0, None, probes[spec.name].reason, EAGER)
            continue
        if done is not None and not done.ok:
            memory = f"; host memory available {format_size(_available())}" if "memory" in done.error else ""
            raise CompileFailed(f"programs: {spec.name} failed to compile ({done.error}){memory}")
        if not load:
            record(spec.name, done.path_taken if done else "HIT", done.seconds if done else 0.0,
                   probes[spec.name].fingerprint, probes[spec.name].reason if done else "")
            continue
        prepared = prepare(spec, cache=cache, backend=backend, device=device_kind)
        runners[spec.name], tiers[spec.name] = prepared.run, COMPILED
        record(spec.name, done.path_taken if done else _path_taken(prepared), prepared.seconds + (done.seconds if done else 0.0),
               prepared.fingerprint, probes[spec.name].reason if done else prepared.reason)
    table = TieredRunners(runners, tiers, on_swap=lambda name: emitter.log(
        phase, f"{name}: compiled tier swapped in", program=name, tier=COMPILED))
    if early:
        threading.Thread(target=_compile_in_background, name="compile-pool", daemon=True,
                         args=(pool, missing, cache, backend, device_kind, table, emitter, phase)).start()
    return table, [results[s.name] for s in specs]


def _run_pool(pool, missing: list, emitter: Emitter, phase: str) -> dict:
    """The pool's run, then one event with what it cost: the sum of compile seconds, the longest,
    the wall, and the host memory peak against its floor (what `dsv4 bench startup` reports)."""
    started = time.perf_counter()
    compiled = pool.run_or_serial(missing)
    seconds = [c.seconds for c in compiled.values()]
    emitter.log(phase, f"compiled {len(compiled)} programs with {pool.jobs} workers", pool=True,
                jobs=pool.jobs, compile_seconds_sum=round(sum(seconds), 3),
                longest_s=round(max(seconds, default=0.0), 3), wall_s=round(time.perf_counter() - started, 3),
                peak_host_used=pool.peak_host_used, floor_bytes=pool.floor_bytes,
                peak_rss=max((c.peak_rss for c in compiled.values()), default=0))
    return compiled


def _available() -> int:
    import psutil

    return psutil.virtual_memory().available


def _pool(options, root: Path, device_kind: str, emitter: Emitter, phase: str,
          stop: threading.Event | None):
    from runtime.compile_pool import CompilePool, default_jobs

    def on_event(program: str, state: str, detail: dict[str, Any]) -> None:
        emitter.log(phase, f"{program}: {state}", program=program, state=state, **detail)

    return CompilePool(root, options.backend, device_kind, options.jobs or default_jobs(),
                       on_event=on_event, stop=stop or threading.Event())


def _compile_in_background(pool, missing, cache, backend, device_kind, table, emitter: Emitter, phase: str) -> None:
    """--ready early: compile, load and stage each program; a failure leaves it eager, once said."""
    from runtime.programs import prepare

    try:
        compiled = _run_pool(pool, missing, emitter, phase)
    except Exception as e:  # the service keeps serving on the eager tier
        compiled = {}
        emitter.log(phase, f"background compile stopped: {e}")
    for spec in missing:
        done = compiled.get(spec.name)
        try:
            if done is None or not done.ok:
                raise RuntimeError(done.error if done is not None else "not compiled")
            table.stage(spec.name, prepare(spec, cache=cache, backend=backend, device=device_kind).run)
        except Exception as e:
            table.fail(spec.name, str(e))
            emitter.log(phase, f"warning: {spec.name} stays eager for the life of this process: {e}",
                        program=spec.name, state="failed")
