"""The running launch as the Registration pane shows it: events in, one row per phase out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from runtime.events import PHASES, Event

PENDING, RUNNING, DONE, FAILED = "pending", "running", "done", "error"
# a program's log events (`programs` phase) say `queued`, `compiling`, then one of these
FINISHED = frozenset({"published", "hit", "loaded", "done", "failed", "eager"})


@dataclass
class PhaseState:
    state: str = PENDING
    done: float | None = None
    total: float | None = None
    seconds: float | None = None
    path: str = ""
    started: float | None = None

    @property
    def fraction(self) -> float:
        if self.state == DONE:
            return 1.0
        if self.done is not None and self.total:
            return max(0.0, min(1.0, self.done / self.total))
        return 0.0


def path_taken(phase: str, detail: dict[str, Any]) -> str:
    """The path a finished phase took, in a few words (from its `end` event's detail)."""
    if "counts" in detail:
        return " ".join(f"{k} {v}" for k, v in detail["counts"].items() if v)
    if "path" in detail:
        return detail["path"] + (f" ({detail['reason']})" if detail.get("reason") else "")
    if "slots" in detail:
        return f"{detail['slots']} slots"
    if "url" in detail:
        return detail["url"]
    if phase == "upload" and "zero_copy" in detail:
        return "zero-copy" if detail["zero_copy"] else "copied"
    if phase == "validate" and "health" in detail:
        return detail["health"]
    return ""


@dataclass
class ProgramStates:
    """Per-program states from a compile pool's log events (`queued`, `compiling`, `published`,
    …), as `dsv4 serve` and `dsv4 compile --events` emit them: done count, what compiles now,
    and the expected seconds the events carry (for the ETA)."""

    states: dict[str, str] = field(default_factory=dict)
    expected: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def applies(detail: dict[str, Any]) -> bool:
        return "program" in detail and "state" in detail

    def feed(self, detail: dict[str, Any]) -> None:
        name = str(detail["program"])
        self.states[name] = str(detail["state"])
        if isinstance(detail.get("expected_s"), int | float):
            self.expected[name] = float(detail["expected_s"])

    @property
    def finished(self) -> set[str]:
        return {n for n, s in self.states.items() if s in FINISHED}

    @property
    def now(self) -> str:
        compiling = [n for n, s in self.states.items() if s == "compiling"]
        return f"compiling {', '.join(compiling)}" if compiling else ""


@dataclass
class LaunchState:
    """One launch in view: its phases, and the prediction made for it and the earlier launch it
    is compared with, both frozen when it started (the pane never mixes two launches)."""

    phases: dict[str, PhaseState] = field(default_factory=lambda: {p: PhaseState() for p in PHASES})
    url: str = ""
    error: str = ""
    spawned: float = field(default_factory=time.time)  # the history record of this launch starts later
    prediction: dict[str, str] = field(default_factory=dict)
    predicted: dict[str, float | None] = field(default_factory=dict)  # seconds per phase (the plan's)
    basis: str = ""
    compared: dict[str, Any] | None = None  # launch-history record of the launch before this one
    stopped: bool = False
    now: dict[str, str] = field(default_factory=dict)  # phase → what it is doing now
    order: list[str] = field(default_factory=list)  # programs in the order the launch prepares them (the plan's)
    pool: ProgramStates = field(default_factory=ProgramStates)  # the programs phase, program by program
    tiers: dict[str, str] = field(default_factory=dict)  # program → eager | compiled (--ready early swaps)

    @property
    def tier_line(self) -> str:
        """"programs: eager 9 · compiled 5" while any program runs eager, else ""."""
        counts = {t: sum(v == t for v in self.tiers.values()) for t in ("eager", "compiled")}
        return "" if not counts["eager"] else f"programs: eager {counts['eager']} · compiled {counts['compiled']}"

    def apply(self, event: Event) -> None:
        if event.phase not in self.phases:
            if event.kind == "error":
                self.error = event.message or "failed"
            return
        p = self.phases[event.phase]
        if "tier" in event.detail and "program" in event.detail:  # a program's tier, or its swap
            self.tiers[str(event.detail["program"])] = str(event.detail["tier"])
        if event.kind == "start":
            p.state, p.started = RUNNING, event.ts
            if isinstance(event.detail.get("total"), int | float):
                p.total = event.detail["total"]
        elif event.kind == "log" and ProgramStates.applies(event.detail):
            self.pool.feed(event.detail)
            if p.state != DONE:
                p.state, p.done = RUNNING, max(p.done or 0, len(self.pool.finished))
            self.now["programs"] = self.pool.now
        elif event.kind == "progress":
            p.state = RUNNING
            p.done, p.total = event.done, event.total
            if event.phase == "programs" and "outcome" in event.detail:
                p.path = f"{event.detail.get('program', '')} {event.detail['outcome']}"
            what = event.detail.get("group") or event.detail.get("part") or ""
            if event.phase == "programs" and event.done is not None and len(self.order) == event.total:
                done = int(event.done)  # progress comes as each program ends: the next one is running
                what = f"preparing {self.order[done]}" if done < len(self.order) else ""
            if what:
                self.now[event.phase] = what
        elif event.kind == "end":
            p.state, p.seconds = DONE, event.seconds
            self.now.pop(event.phase, None)
            p.path = path_taken(event.phase, event.detail)
            if event.phase == "serve":
                self.url = event.detail.get("url", "")
        elif event.kind == "error":
            p.state, p.seconds, p.path = FAILED, event.seconds, event.message or "error"
            self.error = event.message or "failed"

    @property
    def total_seconds(self) -> float:
        return sum(p.seconds or 0.0 for p in self.phases.values())
