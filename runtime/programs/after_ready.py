"""No compile after ready: what a service compiles, loads or specialises once it serves.

The design compiles and loads every program before `/health` turns ready (the programs phase), so
the first request never waits on a compiler and never runs one out of memory (vLLM's V4 warm-up was
found to cover nothing on NVIDIA: the first request compiled and killed a worker). Nothing proved it
under varied traffic; this module counts what breaks it, by program and kind:

- `jit`: torch's JIT (dynamo) compiled a graph during a program's call: an eager `torch.cond`
  compiles its branches, a new shape of such a call compiles again. Read from dynamo's own count of
  the graphs it compiled, before and after each call, and only where dynamo is imported (nothing
  compiles without it; importing it to watch would cost the service half a second of CPU).
  Graphs compiled between calls are put on `OUTSIDE`.
- `load` / `compile`: a program loaded or built in the service process (`runtime.programs.build`).
- `tier-swap`: with `--ready early`, a program's compiled tier loaded and swapped in between two
  steps. The one compiling after ready the design allows: counted and named, never refused.

`--compile-after-ready warn` (the default) logs each one as a sentence; `error` refuses it: the
call raises `CompileAfterReady` (the step fails, its requests each get one error; a JIT compile has
happened by then and torch keeps its graph, so the refusal is the answer, not the work). The counts
are `/metrics`' `dsv4_compiles_after_ready_total{program,kind}`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from store.errors import UserError

WARN, ERROR = "warn", "error"
MODES = (WARN, ERROR)
JIT, LOAD, COMPILE, TIER_SWAP = "jit", "load", "compile", "tier-swap"
OUTSIDE = "(between programs)"  # a JIT graph compiled while no program ran (sampling, the engine's own ops)
_WHAT = {JIT: "torch compiled a graph during its call", LOAD: "loaded", COMPILE: "compiled in the service process",
         TIER_SWAP: "compiled tier swapped in (--ready early)"}


class CompileAfterReady(UserError):
    """A program compiled, loaded or specialised after ready, refused by `--compile-after-ready error`."""


def jit_graphs() -> int:
    """Graphs torch's JIT (dynamo) compiled in this process so far: 0 while it is not imported."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])


class AfterReady:
    """One service's watch: armed once it is ready, then every compile, load or specialisation
    counted by (program, kind), logged (warn) or refused (error)."""

    def __init__(self, mode: str = WARN, log: Callable[..., None] = lambda message, **detail: None):
        if mode not in MODES:
            raise ValueError(f"--compile-after-ready {mode!r}: one of {', '.join(MODES)}")
        self.mode, self._log = mode, log
        self.armed = False
        self.counts: dict[tuple[str, str], int] = {}
        self._listeners: list[Callable[[str, str, int], None]] = []
        self._lock = threading.Lock()
        self._graphs = 0  # dynamo's count when last read (by the engine's thread)

    def arm(self) -> None:
        """The service is ready: from now on everything counts."""
        self._graphs = jit_graphs()
        self.armed = True
        _ARMED.add(self)

    def disarm(self) -> None:
        self.armed = False
        _ARMED.discard(self)

    def listen(self, listener: Callable[[str, str, int], None]) -> None:
        """`listener(program, kind, n)` hears every count from now on, and the counts so far."""
        with self._lock:
            self._listeners.append(listener)
            for (program, kind), n in self.counts.items():
                listener(program, kind, n)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def note(self, program: str, kind: str, n: int = 1) -> None:
        """`n` of `kind` for `program` after ready: counted, then said (warn) or refused (error;
        a tier swap never is)."""
        if not self.armed or n <= 0:
            return
        with self._lock:
            key = (program, kind)
            self.counts[key] = self.counts.get(key, 0) + n
            for listener in self._listeners:
                listener(program, kind, n)
        refused = self.mode == ERROR and kind != TIER_SWAP
        if kind == TIER_SWAP:
            line = f"{program}: {_WHAT[kind]} after ready"
        else:
            line = (f"{'error' if refused else 'warning'}: {program}: {_WHAT[kind]} after the service turned ready"
                    f"{' (refused: --compile-after-ready error)' if refused else ''}")
        self._log(line, program=program, kind=kind, count=self.counts[key], refused=refused)
        if refused:
            raise CompileAfterReady(line.removeprefix("error: "))

    def watched(self, program: str, runner: Callable[..., Any]) -> Callable[..., Any]:
        """`runner` as a call whose JIT compiles count for `program` (any since the last call, for
        `OUTSIDE`)."""
        def call(*args: Any) -> Any:
            self.check()
            before = jit_graphs()
            out = runner(*args)
            after = self._graphs = jit_graphs()
            self.note(program, JIT, after - before)
            return out
        return call

    def check(self) -> None:
        """JIT graphs compiled since the last call of a program, outside any: `OUTSIDE`'s."""
        now = jit_graphs()
        if now != self._graphs:
            before, self._graphs = self._graphs, now
            self.note(OUTSIDE, JIT, now - before)

    def swapped(self, programs: Iterable[str]) -> None:
        """Programs whose compiled tier swapped in at this step's start (`TieredRunners.swap_point`)."""
        for program in programs:
            self.note(program, TIER_SWAP)


# the watches of this process's ready services, which its program loads and builds report to
_ARMED: weakref.WeakSet[AfterReady] = weakref.WeakSet()
_swapping = threading.local()


@contextlib.contextmanager
def for_tier_swap() -> Iterator[None]:
    """Loads and builds in this block are a tier swap's (`--ready early`'s background compile),
    counted when the program swaps in, not as a load."""
    _swapping.on = True
    try:
        yield
    finally:
        _swapping.on = False


def loading(program: str, kind: str = LOAD) -> None:
    """`runtime.programs.build` loads (or builds, `COMPILE`) `program` in this process: counted by
    every ready service's watch, unless a tier swap does it."""
    if getattr(_swapping, "on", False):
        return
    for watch in list(_ARMED):
        watch.note(program, kind)


def arm(runners: Any, mode: str, log: Callable[..., None]) -> AfterReady:
    """The watch of a service now ready, armed: on its runner table (`TieredRunners.watch`) where it
    has one, so program calls and tier swaps report to it; loads and builds report to it anyway."""
    watch = AfterReady(mode, log)
    if hasattr(runners, "watch"):
        runners.watch = watch
    watch.arm()
    return watch
