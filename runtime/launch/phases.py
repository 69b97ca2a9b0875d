"""A launch's phase bookkeeping: each phase's start / end / error events and the record the
launch history keeps of it (torch-free; registration and `dsv4 compile` share it)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from runtime.events import Emitter
from store.errors import UserError


class RegistrationError(UserError):
    """A launch that cannot proceed; the message says which phase and why."""


def why(e: BaseException) -> str:
    """An error's one line; a signal's is "interrupted" (its own text is empty)."""
    if isinstance(e, KeyboardInterrupt | InterruptedError):
        return "interrupted"
    return str(e) or type(e).__name__


class PhaseRecorder:
    """Start/end bookkeeping shared by every phase; collects the launch-history record."""

    def __init__(self, emitter: Emitter):
        self.emitter = emitter
        self.records: dict[str, dict[str, Any]] = {}
        self.failed = ""  # the phase an error (or an interrupt) ended
        self.group = None  # once joined: each phase a rank starts is posted (a dead rank's last phase)
        self.plan = None  # once made: what the history records the launch resolved (device, backend)

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
