"""Program tiers: a program runs eager until its compiled form is published and loaded.

`TieredRunners` is the runner table the engine calls through. Compiled programs arrive from the
background compile pool at any time but are only *staged*; the engine calls `swap_point()` at the
start of each step, so a swap always lands between two steps, never inside one. Tokens never
depend on the tier (the compiled program computes what the eager one does).

Once the service is ready its table carries a watch (`runtime.programs.after_ready`): each program
call is looked up through it, so a JIT compile during the call counts for that program, and each
swap counts as the one compiling after ready the design allows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.programs.after_ready import AfterReady

EAGER, COMPILED = "eager", "compiled"


class TieredRunners(dict):
    """program name → runner, with staged swaps and each program's tier."""

    def __init__(self, runners: dict[str, Callable[..., Any]], tiers: dict[str, str],
                 on_swap: Callable[[str], None] = lambda name: None):
        super().__init__(runners)
        self.tiers = dict(tiers)
        self.failed: dict[str, str] = {}  # program → why it stays eager for the life of the process
        self.steps = {EAGER: 0, COMPILED: 0}  # steps run while any program was eager / all compiled
        self._staged: dict[str, Callable[..., Any]] = {}
        self._lock = threading.Lock()
        self._on_swap = on_swap
        # background compiles wait for the launch to be ready: they never compete for the cores
        # with its own phases (weights, KV, validation on the eager tier), which decide time to ready
        self._released = threading.Event()
        self._go = False
        self.watch: AfterReady | None = None  # set once the service is ready (`after_ready.arm`)

    def __getitem__(self, name: str) -> Callable[..., Any]:
        runner = super().__getitem__(name)
        watch = self.watch
        return runner if watch is None else watch.watched(name, runner)

    def release_compiles(self, go: bool) -> None:
        """The launch is ready (go) or failed (not go): background compiles start, or never do."""
        self._go = go
        self._released.set()

    def compiles_may_start(self) -> bool:
        """Waits for `release_compiles`; whether to compile."""
        self._released.wait()
        return self._go

    def stage(self, name: str, runner: Callable[..., Any]) -> None:
        with self._lock:
            self._staged[name] = runner

    def fail(self, name: str, reason: str) -> None:
        with self._lock:
            self.failed[name] = reason

    def swap_point(self) -> list[str]:
        """Between two steps: install the compiled programs staged since the last step; their names."""
        with self._lock:
            staged, self._staged = self._staged, {}
            for name, runner in staged.items():
                self[name] = runner
                self.tiers[name] = COMPILED
            self.steps[EAGER if EAGER in self.tiers.values() else COMPILED] += 1
        for name in staged:
            self._on_swap(name)
        if self.watch is not None:
            self.watch.check()
            self.watch.swapped(staged)
        return list(staged)

    def status(self) -> str:
        """For /health: "compiled", or "compiling 9/14" while some still run eager."""
        with self._lock:  # a staged program is compiled and loaded: it swaps in at the next step
            done = sum(t == COMPILED or n in self._staged for n, t in self.tiers.items())
            total = len(self.tiers)
            pending = total - done - len(self.failed)
        if done == total:
            return COMPILED
        if pending <= 0:
            return f"eager {total - done}/{total} (compile failed)"
        return f"compiling {done}/{total}"
