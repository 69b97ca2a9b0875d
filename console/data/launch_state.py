"""The running launch as the Registration pane shows it: events in, one row per phase out.
A launch of several ranks keeps each rank's phases too; its rows are their aggregate."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

from console.data.rate import Rate
from console.data.records import LaunchRecord, path_taken
from runtime.events import PHASES, Event
from runtime.launch.history import basis_line, span, whole_seconds

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
    rate: Rate = field(default_factory=Rate)  # its progress events' rate, smoothed (the ETA's)

    @property
    def fraction(self) -> float:
        if self.state == DONE:
            return 1.0
        if self.done is not None and self.total:
            return max(0.0, min(1.0, self.done / self.total))
        return 0.0


@dataclass
class ProgramStates:
    """Per-program states from a compile pool's log events (`queued`, `compiling`, `published`,
    …), as `dsv4 serve` and `dsv4 compile --events` emit them: done count, what compiles now,
    the expected seconds the events carry, when each compile started and what it took, and the
    pool's worker count (for the ETA)."""

    states: dict[str, str] = field(default_factory=dict)
    expected: dict[str, float] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)  # program → when its compile started (wall)
    took: dict[str, float] = field(default_factory=dict)  # program → the seconds its compile took
    workers: int = 1
    said: tuple[float, float, float] | None = None  # (when, ETA, scale) the last `eta` said

    @staticmethod
    def applies(detail: dict[str, Any]) -> bool:
        return "program" in detail and "state" in detail

    def feed(self, detail: dict[str, Any], ts: float | None = None) -> None:
        name, state = str(detail["program"]), str(detail["state"])
        self.states[name] = state
        if isinstance(detail.get("expected_s"), int | float):
            self.expected[name] = float(detail["expected_s"])
        if isinstance(detail.get("workers"), int) and detail["workers"] >= 1:
            self.workers = detail["workers"]
        if state == "compiling":
            self.started[name] = ts if ts is not None else time.time()
        elif state == "published" and isinstance(detail.get("seconds"), int | float):
            self.took[name] = float(detail["seconds"])

    @property
    def finished(self) -> set[str]:
        return {n for n, s in self.states.items() if s in FINISHED}

    @property
    def now(self) -> str:
        compiling = [n for n, s in self.states.items() if s == "compiling"]
        more = f" +{len(compiling) - 1}" if len(compiling) > 1 else ""  # a pool compiles several at once
        return f"compiling {compiling[0]}{more}" if compiling else ""

    def scale(self) -> float:
        """How this host's compiles compare with what was expected of them: the finished ones'
        seconds over their expectation (1 until one with both has finished)."""
        both = [(self.took[n], self.expected[n]) for n in self.took if self.expected.get(n)]
        expected = sum(e for _, e in both)
        return sum(t for t, _ in both) / expected if expected > 0 else 1.0

    def eta(self, now: float | None = None) -> float | None:
        """Seconds until every program is through: what is left of each (its expected seconds,
        scaled by `scale`; a running one less what it has run), laid on the pool's workers
        longest first, as the pool takes them; None with nothing expected to go by. While the
        scale stands and no compile overruns it never rises (`said`: what it said last)."""
        import heapq

        now = now if now is not None else time.time()
        left = [n for n, s in self.states.items() if s not in FINISHED]
        if not left:
            return 0.0
        known = [self.expected[n] for n in left if self.expected.get(n)]
        if not known:
            return None
        mean, k = sum(known) / len(known), self.scale()

        def cost(name: str) -> float:
            return (self.expected.get(name) or mean) * k

        running = [cost(n) - (now - self.started[n]) for n in left
                   if self.states[n] == "compiling" and n in self.started]
        on_time = all(r >= 0 for r in running)  # no compile past what the scale says it takes
        running = [max(0.0, r) for r in running]
        free = sorted(running)[: self.workers] + [0.0] * max(0, self.workers - len(running))
        heapq.heapify(free)
        for c in sorted((cost(n) for n in left if self.states[n] != "compiling"), reverse=True):
            heapq.heappush(free, heapq.heappop(free) + c)
        eta = max(free)
        if on_time and self.said is not None and now >= self.said[0] and abs(k - self.said[2]) <= 0.01 * k:
            # compiles keep the rate measured (the scale stands, none overruns): the ETA counts
            # down, never up — the pool's own order is not the longest-first this lays them in
            eta = min(eta, max(0.0, self.said[1] - max(0.0, now - self.said[0])))
        self.said = (now, eta, k)
        return eta


def step(phases: dict[str, PhaseState], now: dict[str, str], pool: ProgramStates, order: list[str],
         event: Event) -> None:
    """One event into one process's phases: the whole launch of a single process, or one rank's."""
    p = phases[event.phase]
    if event.kind == "start":
        p.state, p.started = RUNNING, event.ts
        p.rate.sample(event.ts, 0.0)
        if isinstance(event.detail.get("total"), int | float):
            p.total = event.detail["total"]
    elif event.kind == "log" and ProgramStates.applies(event.detail):
        pool.feed(event.detail, event.ts)
        if p.state != DONE:
            p.state, p.done = RUNNING, max(p.done or 0, len(pool.finished))
        now["programs"] = pool.now
    elif event.kind == "progress":
        p.state = RUNNING
        p.done, p.total = event.done, event.total
        if event.done is not None:
            p.rate.sample(event.ts, event.done)
        if event.phase == "programs" and "outcome" in event.detail:
            p.path = f"{event.detail.get('program', '')} {event.detail['outcome']}"
        what = event.detail.get("group") or event.detail.get("part") or ""
        if event.phase == "programs" and event.done is not None and len(order) == event.total:
            done = int(event.done)  # progress comes as each program ends: the next one is running
            what = f"preparing {order[done]}" if done < len(order) else ""
        if what:
            now[event.phase] = what
    elif event.kind == "end":
        p.state, p.seconds = DONE, event.seconds
        now.pop(event.phase, None)
        p.path = path_taken(event.phase, event.detail)
    elif event.kind == "error":
        p.state, p.seconds, p.path = FAILED, event.seconds, event.message or "error"


@dataclass
class Track:
    """One rank's own phases, what it does now and its programs, as its events tell them."""

    phases: dict[str, PhaseState] = field(default_factory=lambda: {p: PhaseState() for p in PHASES})
    now: dict[str, str] = field(default_factory=dict)
    pool: ProgramStates = field(default_factory=ProgramStates)

    def where(self) -> tuple[str, PhaseState]:
        """The phase this rank is at: its failed phase, else the furthest one it started
        ("-" before its first event)."""
        failed = [ph for ph in PHASES if self.phases[ph].state == FAILED]
        started = [ph for ph in PHASES if self.phases[ph].state != PENDING]
        phase = (failed or started[-1:] or ["-"])[0]
        return phase, self.phases.get(phase) or PhaseState()


@dataclass(frozen=True)
class RankProgress:
    """Where one rank of a multi-rank launch is: the phase, its state and its fraction."""

    rank: int
    phase: str
    state: str
    fraction: float
    message: str = ""  # the error, when it failed


SMALL_DELTA_S = 0.1  # a difference this small says nothing as a share (10 ms against 2 ms is "+400 %")


def delta(actual: float | None, predicted: float | None) -> str:
    """`+12 %`, `−3 %`; under 0.1 s apart, the seconds (`+0.04 s`); "" when either is unknown."""
    if actual is None or predicted is None:
        return ""
    if abs(actual - predicted) < SMALL_DELTA_S:
        return f"{'+' if actual >= predicted else '−'}{abs(actual - predicted):.2f} s"
    if not predicted:
        return ""
    change = (actual - predicted) / predicted
    return f"{'+' if change >= 0 else '−'}{abs(change):.0%}"


RANK0_ONLY = frozenset({"serve"})  # phases only rank 0 runs


def _by_rank(rank: int | None, message: str) -> str:
    """`rank 2: kv: …` — a rank's error names its rank (once)."""
    return message if rank is None or re.match(rf"rank {rank}\b", message) else f"rank {rank}: {message}"


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
    compared: LaunchRecord | None = None  # the launch before this one
    stopped: bool = False
    now: dict[str, str] = field(default_factory=dict)  # phase → what it is doing now
    order: list[str] = field(default_factory=list)  # programs in the order the launch prepares them (the plan's)
    pool: ProgramStates = field(default_factory=ProgramStates)  # the programs phase, program by program
    tiers: dict[str, str] = field(default_factory=dict)  # program → eager | compiled (--ready early swaps)
    # a launch of several ranks: each rank's own phases (`phases` is then their aggregate) and the
    # world size its check announced
    ranks: dict[int, Track] = field(default_factory=dict)
    world: int | None = None
    # the figures its history record keeps, as its serve event says them: the whole launch (process
    # start to serving) and its registration span (check through validate)
    launch_seconds: float | None = None
    registration_seconds: float | None = None
    ended: str = ""  # how the service's process ended, its cause, once it has ("killed by SIGKILL during serve")
    ending: Any = None  # the registry's store.services.Ending it was read from (its time: the age moves)

    def current_phase(self) -> str:
        """The phase the launch is in: the one running, else serve once it served, else the last
        one that started ("" before any)."""
        running = [p for p in PHASES if self.phases[p].state == RUNNING]
        if running:
            return running[0]
        if self.url:
            return "serve"
        started = [p for p in PHASES if self.phases[p].state != PENDING]
        return started[-1] if started else ""

    def end(self, line: str, failed: bool, ending: Any = None) -> None:
        """The service's process is gone: how (`line`: the cause; `ending`: the registry's value,
        whose age `ended_line` renders as time goes), and (when it did not stop as asked) the
        phase it was in fails, so no row says ✓ or "serving" beside a process that is not there."""
        phase = self.current_phase()
        self.ended, self.ending = line, ending
        if failed and phase and self.phases[phase].state != FAILED:
            p = self.phases[phase]
            p.state, p.path = FAILED, line
        elif not failed:
            self.stopped = True

    def ended_line(self, now: float | None = None) -> str:
        """How it ended with its age as of `now` (`killed by SIGKILL 2 min ago during serve`): one
        clock for the header, this pane and the Services pane, rendered again as it moves."""
        return self.ending.line(now) if self.ending is not None else self.ended

    @property
    def tier_line(self) -> str:
        """"programs: eager 9 · compiled 5" while any program runs eager, else ""."""
        counts = {t: sum(v == t for v in self.tiers.values()) for t in ("eager", "compiled")}
        return "" if not counts["eager"] else f"programs: eager {counts['eager']} · compiled {counts['compiled']}"

    def apply(self, event: Event) -> None:
        if event.phase not in self.phases:
            if event.kind == "error":
                self.error = _by_rank(event.rank, event.message or "failed")
            return
        if "tier" in event.detail and "program" in event.detail:  # a program's tier, or its swap
            self.tiers[str(event.detail["program"])] = str(event.detail["tier"])
        if event.rank is not None:
            self._apply_rank(event)
        elif not (event.kind == "error" and self.ranks and self._rank_died(event)):
            step(self.phases, self.now, self.pool, self.order, event)
        if event.kind == "end" and event.phase == "check" and event.rank in (None, 0):
            self._planned(event.detail.get("plan"))
        if event.kind == "end" and event.phase == "serve":
            self.url = event.detail.get("url", "")
            for name in ("launch_seconds", "registration_seconds"):
                if isinstance(event.detail.get(name), int | float):
                    setattr(self, name, float(event.detail[name]))
        elif event.kind == "error":
            self.error = _by_rank(event.rank, event.message or "failed")

    def _planned(self, raw: Any) -> None:
        """The prediction this launch's own plan made (its check event carries it): what its
        actuals are compared with, whatever plan the console makes next."""
        from runtime.launch.plan_report import PlanReport

        try:
            plan = PlanReport.from_json(raw)
        except (ValueError, TypeError, KeyError):  # another dsv4's plan: keep the console's prediction
            return
        self.predicted = dict(plan.predicted)
        self.basis = basis_line(dict(plan.basis), dict(plan.compared) if plan.compared else None)

    def registration(self) -> tuple[float | None, float] | None:
        """(predicted, actual) seconds of the registration span (check, programs ∥ weights, upload,
        kv, validate: `history.span`, the record's one formula) once the launch is through it:
        the actual its record keeps (the serve event's), else the span of each phase's seconds
        (the slowest rank's); the predicted the span of the plan's (None while a phase's is unknown)."""
        from runtime.events import REGISTRATION

        actual = self.registration_seconds
        if actual is None and all(self.phases[p].state == DONE for p in REGISTRATION):
            actual = span({p: self.phases[p].seconds for p in REGISTRATION})
        return None if actual is None else (span(self.predicted), actual)

    def _apply_rank(self, event: Event) -> None:
        track = self.ranks.setdefault(event.rank, Track())
        step(track.phases, track.now, track.pool, self.order, event)
        world = event.detail.get("ranks")
        if event.phase == "check" and event.kind == "start" and isinstance(world, int) and world >= 1:
            self.world = world
        for phase in PHASES:  # a rank heard from for the first time, or the world size, moves every row
            self._aggregate(phase)

    def _rank_died(self, event: Event) -> bool:
        """The launcher's error on a rank that died (no rank of its own; its detail names the
        rank and the phase it was in): that rank failed that phase, though it could not say so."""
        rank, phase = event.detail.get("rank"), event.detail.get("phase")
        if not isinstance(rank, int) or phase not in PHASES:
            return False
        p = self.ranks.setdefault(rank, Track()).phases[phase]
        if p.state != DONE:
            p.state, p.path = FAILED, event.message or "died"
        self._aggregate(phase)
        return True

    def _members(self) -> dict[int, Track]:
        """Every rank of the launch, in order: the check's world size, else the ranks heard from."""
        known = set(range(self.world or 0)) | set(self.ranks)
        return {r: self.ranks.get(r) or Track() for r in sorted(known)}

    def _aggregate(self, phase: str) -> None:
        """The pane's row for `phase` from the ranks': failed if any failed, done when all are,
        the slowest rank's progress, the longest rank's seconds, rank 0's path."""
        states = {r: t.phases[phase] for r, t in self._members().items() if phase not in RANK0_ONLY or r == 0}
        if all(p.state == PENDING for p in states.values()):
            return  # no rank is in it yet: the row stays as it is
        failed = [r for r, p in states.items() if p.state == FAILED]
        agg = self.phases[phase]
        agg.state = (FAILED if failed else DONE if all(p.state == DONE for p in states.values()) else RUNNING)
        slowest = min(states, key=lambda r: states[r].fraction)
        agg.done, agg.total, agg.rate = states[slowest].done, states[slowest].total, states[slowest].rate
        seconds = [p.seconds for p in states.values() if p.seconds is not None]
        agg.seconds = max(seconds) if seconds else None
        started = [p.started for p in states.values() if p.started is not None]
        agg.started = min(started) if started else None
        agg.path = (_by_rank(failed[0], states[failed[0]].path) if failed
                    else states[0].path if 0 in states else "")
        running = [r for r in states if states[r].state == RUNNING]
        behind = self.ranks[min(running, key=lambda r: states[r].fraction)] if running else None
        if behind and behind.now.get(phase):  # what the phase does now: on its slowest rank
            self.now[phase] = behind.now[phase]
        else:
            self.now.pop(phase, None)
        if behind and phase == "programs":
            self.pool = behind.pool

    def rank_progress(self) -> list[RankProgress]:
        """Where each rank is (phase, state, fraction), in rank order; empty for fewer than two."""
        members = self._members()
        if len(members) < 2:
            return []
        out = []
        for r, track in members.items():
            phase, p = track.where()
            out.append(RankProgress(r, phase, p.state, p.fraction, p.path if p.state == FAILED else ""))
        return out

    @property
    def slowest(self) -> RankProgress | None:
        """The rank furthest behind (the earliest phase, then the lowest fraction of it) while
        ranks still register; None for fewer than two ranks, after a failure, or once all are through."""
        ranks = self.rank_progress()
        if not ranks or any(r.state == FAILED for r in ranks):
            return None

        def key(r: RankProgress) -> tuple[int, float, int]:
            return (PHASES.index(r.phase) if r.phase in PHASES else -1, r.fraction, r.rank)

        behind = min(ranks, key=key)
        through = behind.phase in RANK0_ONLY or (behind.phase == "validate" and behind.state == DONE)
        return None if through else behind

    @property
    def total_seconds(self) -> float:
        """The whole launch's seconds as its history record says them (`history.launch_seconds`):
        from its process's start to serving, else (it never served) its phases' sum."""
        return whole_seconds(self.launch_seconds, {name: p.seconds for name, p in self.phases.items()})
