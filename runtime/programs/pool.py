"""Compiling missing programs in a pool of worker processes.

Longest first (by the compile seconds last recorded for that program), after the native programs
(`compile_order`), at most `jobs` at once,
and never starting a job that would take the host's available memory below `floor_bytes` (the
job's expected peak RSS is the one last recorded for that program; with nothing running, one job
starts anyway, so the pool degrades to serial instead of waiting forever). Every worker publishes
through the kernel cache's normal path, so two pools on one cache compile each key once between
them. Each result is reported the moment its worker ends (`on_done`), so the parent can load
a published program while the others still compile. `stop` cancels: workers are killed within a
second and their staging dirs swept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.programs.outcome import Outcome
from runtime.programs.worker import spec_to_json
from store.kernel_cache.inventory import sweep_staging
from store.kernel_cache.read import manifests

log = logging.getLogger(__name__)
DEFAULT_RSS = 1 << 30  # expected peak of a compile never measured on this host
POLL_S = 0.05
KILL_GRACE_S = 1.0
# torch's export and its loaders are not safe in two threads of one process at once: an export
# beside a torch.export.load in another thread fails now and then ("found a fake tensor in the
# exported program constant's list"). A compile in this process (the serial fallback) holds this,
# and so does every load that may run beside one (`program_prep`'s loader thread).
IN_PROCESS_TORCH = threading.Lock()


def default_jobs(floor_bytes: int | None = None) -> int:
    """The CPUs this process may use, capped by memory (available above the floor / 1 GiB each)."""
    import psutil

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    spare = psutil.virtual_memory().available - (floor_bytes if floor_bytes is not None else default_floor())
    return max(1, min(cpus, spare // DEFAULT_RSS))


def default_floor() -> int:
    """Keep a tenth of host memory (at least 512 MiB) free for everything else on the host."""
    import psutil

    return max(512 << 20, psutil.virtual_memory().total // 10)


@dataclass
class Compiled:
    program: str
    ok: bool
    seconds: float = 0.0
    peak_rss: int = 0
    error: str = ""
    outcome: str = ""  # compiled | hit (another process published it meanwhile) | uncached
    miss_kind: str = ""  # why it was not cached: absent | stale | corrupt | …

    @property
    def path_taken(self) -> Outcome:
        """What this launch found for the program: HIT (published by another meanwhile) or why not."""
        return Outcome.HIT if self.outcome == "hit" else Outcome.of_miss(self.miss_kind)


OnDone = Callable[[Compiled], None]


def _ignore(compiled: Compiled) -> None:
    pass


@dataclass
class _Running:
    spec: Any
    proc: subprocess.Popen
    out: tuple[Any, Any]  # the worker's stdout and stderr: files, read once it has exited
    started: float
    expected_rss: int


def compile_order(specs: Iterable[Any], history: dict[str, tuple[float, int]]) -> list[Any]:
    """The order a pool starts its jobs in. Longest first (by the seconds last recorded), which
    ends the last job soonest; but the programs built from C++ source (`experts.native`) before
    every other: about a second each, and from then on the eager tier standing in for the programs
    still compiling runs its FP4, FP8 and BF16 products natively (`ops.linear`): a decode step of
    `small` on 2 AMD cores 157 → 79 ms (measured with nothing compiling beside it), for about two
    seconds of the pool's wall, against the few minutes its compiles take."""
    from runtime.programs.spec import is_native

    return sorted(specs, key=lambda s: (not is_native(s), -(history.get(s.name, (0.0, 0))[0])))


@dataclass
class CompilePool:
    cache_root: Path
    backend: str
    device: str
    jobs: int = 1
    floor_bytes: int = field(default_factory=default_floor)
    on_event: Callable[[str, str, dict[str, Any]], None] = lambda program, state, detail: None
    stop: threading.Event = field(default_factory=threading.Event)
    peak_host_used: int = 0  # the most host memory in use while the pool ran (for the bench)

    def run_or_serial(self, specs: list[Any], on_done: OnDone = _ignore) -> dict[str, Compiled]:
        """`run`, or, when no worker process can be started, one compile after another in this
        process (with one warning): slower, never stuck. `on_done` hears each program's result
        once, as soon as it is known."""
        history = compile_history(self.cache_root, [s.name for s in specs])
        done: dict[str, Compiled] = {}

        def report(compiled: Compiled) -> None:
            done[compiled.program] = compiled
            on_done(compiled)

        try:
            return self.run(specs, history, report)
        except InterruptedError:  # an OSError too, but a cancel, not a pool that cannot start
            raise
        except OSError as e:
            log.warning("compile pool cannot start (%s): compiling serially in this process", e)
            self.on_event("*", "serial", {"error": str(e)})
            self._serial([s for s in specs if s.name not in done], report)  # what workers did stands
            return done

    def _serial(self, specs: list[Any], on_done: OnDone) -> None:
        from runtime.programs.build import prepare
        from runtime.programs.worker import peak_rss_bytes
        from store.kernel_cache import KernelCache

        cache = KernelCache(self.cache_root)
        for spec in specs:
            if self.stop.is_set():
                raise InterruptedError("compile cancelled")
            started = time.perf_counter()
            try:
                with IN_PROCESS_TORCH:
                    p = prepare(spec, cache=cache, backend=self.backend, device=self.device, load=False)
                compiled = Compiled(spec.name, True, time.perf_counter() - started, peak_rss_bytes(),
                                    "", p.outcome, p.miss_kind)
            except Exception as e:
                compiled = Compiled(spec.name, False, time.perf_counter() - started, 0, str(e))
            on_done(compiled)

    def run(self, specs: Iterable[Any], history: dict[str, tuple[float, int]] | None = None,
            on_done: OnDone = _ignore) -> dict[str, Compiled]:
        """Compile `specs`; history maps program → (last compile seconds, last peak RSS).
        `on_done(result)` runs in this thread the moment a worker ends (published or failed):
        keep it short, the pool starts no job meanwhile."""
        history = history or {}
        queue = compile_order(specs, history)
        for spec in queue:
            # the workers too: an ETA is the expected seconds spread over them, not their sum
            self.on_event(spec.name, "queued", {"expected_s": history.get(spec.name, (None, 0))[0],
                                                "workers": self.jobs})
        running: list[_Running] = []
        done: dict[str, Compiled] = {}
        try:
            while queue or running:
                if self.stop.is_set():
                    raise InterruptedError("compile cancelled")
                self._start_what_fits(queue, running, history)
                for r in list(running):
                    if r.proc.poll() is not None:
                        running.remove(r)
                        done[r.spec.name] = self._finish(r)
                        on_done(done[r.spec.name])
                self._sample_memory()
                if running:
                    time.sleep(POLL_S)
        finally:
            self._cancel(running)
        return done

    def _start_what_fits(self, queue: list, running: list[_Running], history) -> None:
        import psutil

        while queue and len(running) < self.jobs:
            spec = queue[0]
            expected = history.get(spec.name, (0.0, 0))[1] or DEFAULT_RSS
            available = psutil.virtual_memory().available
            if running and available - expected < self.floor_bytes:
                return  # would push the host below the floor: wait for a running job to end
            queue.pop(0)
            proc, out = self._spawn(spec)
            running.append(_Running(spec, proc, out, time.monotonic(), expected))
            self.on_event(spec.name, "compiling", {"expected_rss": expected, "available": available, "pid": proc.pid})

    def _spawn(self, spec) -> tuple[subprocess.Popen, tuple[Any, Any]]:
        """A worker whose stdout and stderr go to unnamed temporary files, not pipes: a compile
        that says more than a pipe holds (Inductor's and Triton's warnings on a GPU) would block
        on its write while the pool waits for it to exit."""
        import tempfile

        job = {"spec": spec_to_json(spec), "cache_root": str(self.cache_root), "backend": self.backend,
               "device": self.device}
        # closed by _finish or _cancel, once the worker has exited
        out = (tempfile.TemporaryFile(), tempfile.TemporaryFile())  # noqa: SIM115
        try:
            proc = subprocess.Popen([sys.executable, "-m", "runtime.programs.worker"], stdin=subprocess.PIPE,
                                    stdout=out[0], stderr=out[1], text=True,
                                    cwd=Path(__file__).resolve().parents[2], start_new_session=True)
        except BaseException:
            _close(out)
            raise
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        return proc, out

    def _finish(self, r: _Running) -> Compiled:
        out, err = (_read(f).strip().splitlines() for f in r.out)
        _close(r.out)
        elapsed = time.monotonic() - r.started
        result = None
        with contextlib.suppress(ValueError, IndexError):
            result = json.loads(out[-1])  # the worker's last line: its result
        if r.proc.returncode != 0 or not isinstance(result, dict):
            code = r.proc.returncode
            why = (f"killed by signal {-code}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
                   if code < 0 else f"exit {code}")
            tail = err[-1:]
            compiled = Compiled(r.spec.name, False, elapsed, 0, "; ".join([why, *tail]))
        else:
            compiled = Compiled(r.spec.name, bool(result.get("ok")), float(result.get("seconds", elapsed)),
                                int(result.get("peak_rss", 0)), str(result.get("error", "")),
                                str(result.get("outcome", "")), str(result.get("miss_kind", "")))
        self.on_event(r.spec.name, "published" if compiled.ok else "failed",
                      {"seconds": round(compiled.seconds, 3), "peak_rss": compiled.peak_rss, "error": compiled.error})
        return compiled

    def _sample_memory(self) -> None:
        import psutil

        vm = psutil.virtual_memory()
        self.peak_host_used = max(self.peak_host_used, vm.total - vm.available)

    def _cancel(self, running: list[_Running]) -> None:
        """Kill what still runs (SIGTERM, then SIGKILL after a grace) and sweep its staging."""
        if not running:
            return
        for r in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + KILL_GRACE_S
        for r in running:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
        from store.kernel_cache import KernelCache

        cache = KernelCache(self.cache_root)
        for r in running:
            _close(r.out)
            with contextlib.suppress(Exception):
                sweep_staging(cache.layout, r.spec.name)
            self.on_event(r.spec.name, "cancelled", {})


def _read(f) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


def _close(files) -> None:
    for f in files:
        f.close()


def compile_history(cache_root: Path, programs: Iterable[str]) -> dict[str, tuple[float, int]]:
    """Program → (compile seconds, peak RSS) last recorded in any manifest of that program."""
    from store.kernel_cache import KernelCache

    out = {}
    cache = KernelCache(cache_root)
    for program in programs:
        with contextlib.suppress(Exception):
            newest = max(manifests(cache.layout, program), key=lambda m: m.created, default=None)
            if newest is not None:
                out[program] = (newest.compile_seconds, newest.compile_peak_rss)
    return out
