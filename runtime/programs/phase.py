"""The programs phase: every program HIT (verified load) or compiled in a pool of worker
processes and loaded the moment it publishes, while the rest still compile; with `--ready early`,
missing ones run eager and swap in as they publish."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.events import Emitter
from runtime.plan import miss_path
from store.errors import UserError
from store.units import format_size

if TYPE_CHECKING:
    from runtime.compile_pool import Compiled


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
    processes (`options.jobs`, longest first, within a memory floor), each loading as soon as it
    publishes. With `options.ready == "early"` the missing ones run eager meanwhile and swap in
    as they publish (`TieredRunners`); otherwise this returns when all are loaded. `load=False`
    (`dsv4 compile`) only makes sure every program is published. Returns (runners, results)."""
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
    if not load:
        compiled = _run_pool(pool, missing, emitter, phase) if missing else {}
        for spec in specs:
            done = compiled.get(spec.name)
            _raise_if_failed(spec, done)
            record(spec.name, done.path_taken if done else "HIT", done.seconds if done else 0.0,
                   probes[spec.name].fingerprint, probes[spec.name].reason if done else "")
        return TieredRunners({}, {}), [results[s.name] for s in specs]

    def load_one(spec, done: Compiled | None = None) -> Callable[..., Any]:
        """A HIT, or a program the pool has just published (`done`), loaded verified."""
        prepared = _load(spec, cache, backend, device_kind)
        record(spec.name, done.path_taken if done else _path_taken(prepared),
               prepared.seconds + (done.seconds if done else 0.0), prepared.fingerprint,
               probes[spec.name].reason if done else prepared.reason)
        return prepared.run

    early = options.ready == "early" and bool(missing)
    if early:
        runners, tiers = {}, {}
        for spec in specs:
            if spec in missing:
                runners[spec.name], tiers[spec.name] = prepare(spec, cache=None, backend="eager", device=device_kind).run, EAGER
                record(spec.name, miss_path(probes[spec.name].kind), 0.0, None, probes[spec.name].reason, EAGER)
            else:
                runners[spec.name], tiers[spec.name] = load_one(spec), COMPILED
    else:
        runners = _load_while_compiling(pool, specs, missing, load_one, emitter, phase)
        tiers = dict.fromkeys(runners, COMPILED)
    table = TieredRunners(runners, tiers, on_swap=lambda name: emitter.log(
        phase, f"{name}: compiled tier swapped in", program=name, tier=COMPILED))
    if early:
        threading.Thread(target=_compile_in_background, name="compile-pool", daemon=True,
                         args=(pool, missing, cache, backend, device_kind, table, emitter, phase)).start()
    return table, [results[s.name] for s in specs]


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


def _load(spec, cache, backend: str, device_kind: str):
    """`prepare` (a verified load of the published entry), never beside a compile that runs in
    this process (the pool's serial fallback): torch does not allow the two at once."""
    from runtime.compile_pool import IN_PROCESS_TORCH
    from runtime.programs import prepare

    with IN_PROCESS_TORCH:
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
    """--ready early: each program loaded and staged the moment it publishes, so they swap in one
    by one; a failure leaves it eager, once said."""
    if not table.compiles_may_start():
        return  # the launch failed: nothing will serve
    by_name = {s.name: s for s in missing}
    settled: set[str] = set()  # staged or said to stay eager (written by the loader thread only)

    def stage(done: Compiled) -> None:
        settled.add(done.program)
        try:
            if not done.ok:
                raise RuntimeError(done.error)
            table.stage(done.program, _load(by_name[done.program], cache, backend, device_kind).run)
        except Exception as e:
            _stays_eager(table, done.program, e, emitter, phase)

    with _loader() as loader:
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
