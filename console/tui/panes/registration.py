"""Registration pane: one launch at a time. Before a launch, the predicted path of each phase
for the next one; during and after a launch, that launch's phases (progress, seconds, path,
what it does now, ETA) next to the prediction made for it and the launch it is compared with,
named by its start time and pid."""

from __future__ import annotations

import time
from typing import Any

from rich.markup import escape
from textual.app import ComposeResult
from textual.widgets import Static

from console import fmt
from console.data.eta import Progress
from console.data.launch_state import DONE, FAILED, RUNNING, LaunchState, ProgramStates, delta
from console.data.records import LaunchRecord
from console.data.snapshot import RegistrationSnapshot
from console.tui.panes.base import Pane
from console.tui.tables import Column, PaneTable
from runtime.events import PHASES, REGISTRATION
from runtime.launch.history import span

STATE_MARK = {DONE: "[green]✓[/]", FAILED: "[red]✗[/]", RUNNING: "[yellow]…[/]"}
COLUMNS = (
    Column("phase", "phase", 10, essential=True),
    Column("progress", "progress", 9, essential=True),
    Column("seconds", "s", 7, essential=True),
    Column("delta", "vs plan", 7),
    Column("path", "path", 16),
    Column("predicted", "predicted", 22),
    Column("compared", "compared", 12),
    Column("best", "best warm", 12),
)


def _past(record: LaunchRecord | None, phase: str) -> str:
    p = record.phase(phase) if record else None
    return p.line() if p else "-"


def launch_name(record: LaunchRecord | None) -> str:
    """`14:02:33 pid 4242 (ok, 0.90 s)`: which launch a comparison is with."""
    return record.name() if record else "none"


def phase_progress(phase: str, p, expected: float | None, now: str, pool: ProgramStates | None = None) -> str:
    """The running phase's progress line (elapsed, ETA from the plan or the compared launch, or
    the compile pool's own: what is left spread over its workers, what it does now)."""
    elapsed = max(0.0, time.time() - (p.started or time.time()))
    tracker = Progress(phase, "bytes" if phase == "weights" else "", p.done, p.total, now,
                       started=p.started or time.time(), pool=pool if pool is not None and pool.expected else None,
                       measured=p.rate, clock=time.time)
    if expected and p.total:
        tracker.rate = p.total / expected
    elif expected and tracker.pool is None:  # no done/total: the ETA is what is left of its recorded time
        return fmt.progress(phase, None, None, "", elapsed, max(0.0, expected - elapsed), "history", now)
    return tracker.line()


def registration_line(predicted: float | None, actual: float) -> str:
    """`registration predicted 3.00 s · actual 3.50 s (+17%)`: one span (check through validate,
    programs ∥ weights) on both sides, as the launch's history record keeps them."""
    if predicted is None:
        return f"registration {actual:.2f} s (not predicted: a phase's seconds were unknown)"
    return f"registration predicted {predicted:.2f} s · actual {actual:.2f} s ({delta(actual, predicted)})"


RANKS_PER_LINE = 4


def rank_lines(launch: LaunchState) -> list[str]:
    """A launch of two ranks or more: the slowest rank named, then where each rank is, a few
    ranks a line (`rank 0 … weights ██░░  40%`) so the phase table keeps its rows; a rank's
    error is in the summary already (named by its rank). Nothing for a single process."""
    ranks = launch.rank_progress()
    if not ranks:
        return []
    slow = launch.slowest
    lines = [f"slowest: rank {slow.rank} ({slow.phase} {slow.fraction:.0%})"] if slow else []
    cells = [f"rank {r.rank} {STATE_MARK.get(r.state, ' ')} {r.phase if r.phase != '-' else 'not started'} "
             f"{fmt.bar(r.fraction, 4)}" for r in ranks]
    lines += ["   ".join(cells[i:i + RANKS_PER_LINE]) for i in range(0, len(cells), RANKS_PER_LINE)]
    return lines


class RegistrationPane(Pane):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)

    def compose(self) -> ComposeResult:
        yield PaneTable("registration", COLUMNS, lambda row: row["cells"], id="registration-table")
        yield Static(id="registration-summary", classes="totals")
        ranks = Static(id="registration-ranks")  # its own lines: the summary's are capped at four
        ranks.display = False  # until a launch of several ranks
        yield ranks

    def on_mount(self) -> None:
        self.border_title = "Registration"

    def show(self, snap: RegistrationSnapshot, launch: LaunchState | None, status: str = "") -> None:
        compared = launch.compared if launch else snap.previous
        prediction = launch.prediction if launch else snap.prediction
        seconds_ahead = launch.predicted if launch else snap.predicted
        rows, running = [], []
        for phase in PHASES:
            p = launch.phases[phase] if launch else None
            mark = STATE_MARK.get(p.state, " ") if p else " "
            seconds = p.seconds if p and p.seconds is not None else (
                time.time() - p.started if p and p.state == RUNNING and p.started else None)
            ahead = seconds_ahead.get(phase)
            predicted = (f"{fmt.secs(ahead)} " if ahead is not None else "") + prediction.get(phase, "")
            done = p is not None and p.state in (DONE, FAILED)
            cells = {"phase": f"{mark} {phase}", "progress": fmt.bar(p.fraction if p else 0.0, 4),
                     "seconds": fmt.secs(seconds), "delta": delta(p.seconds if done else None, ahead),
                     "path": p.path if p else "",
                     "predicted": predicted, "compared": _past(compared, phase),
                     "best": _past(snap.best_warm, phase)}
            rows.append({"phase": phase, "cells": cells, "path_taken": p.path if p else "",
                         "predicted": prediction.get(phase, ""), "compared": _past(compared, phase)})
            if p and p.state == RUNNING:  # ETA: the plan's seconds, else the compared launch's
                past = compared.phase(phase) if compared else None
                expected = ahead if ahead is not None else (past.seconds if past else None)
                running.append(phase_progress(phase, p, expected, launch.now.get(phase, ""),
                                              launch.pool if phase == "programs" else None))
        table = self.query_one(PaneTable)
        table.set_rows(rows)
        now_running = [i for i, phase in enumerate(PHASES) if launch and launch.phases[phase].state == RUNNING]
        if now_running:  # a short pane scrolls to the phase that runs
            table.move_cursor(row=now_running[0])
        self.border_title = "Registration: " + ("this launch" if launch else "next launch (predicted)")
        parts = []
        if launch:
            running_now = any(ph.state == RUNNING for ph in launch.phases.values())
            parts.append(f"this launch {fmt.duration(time.time() - launch.spawned)} elapsed" if running_now
                         else f"this launch {launch.total_seconds:.2f} s")
            if launch.ended and not launch.stopped:  # never "serving" beside a process that is gone
                parts.append(f"[red]ended: {escape(launch.ended_line())}[/]")
            elif launch.stopped:
                parts.append("[yellow]service stopped[/]")
            elif launch.url:
                parts.append(f"[green]serving {launch.url}[/]")
            if launch.error and launch.error not in launch.ended:  # one failure, one line
                parts.append(f"[red]{launch.error}[/]")
            if launch.tier_line:
                parts.append(launch.tier_line)
            if (both := launch.registration()) is not None:  # first: a collapsed pane (below 120×36) keeps it
                parts.insert(0, registration_line(*both))
        elif any(s is not None for s in seconds_ahead.values()):  # "at least" while a phase is unknown
            at_least = "≥ " if any(s is None for s in seconds_ahead.values()) else ""
            lower = span({p: seconds_ahead.get(p) or 0.0 for p in REGISTRATION})
            parts.append(f"next launch: registration predicted {at_least}{lower:.2f} s")
        if status and not (launch and launch.stopped and "stopped" in status):
            parts.append(status)
        # the running phase first: a collapsed pane (below 120×36) shows only its first line
        lines = [*running, "  ".join(parts)] if parts else list(running)
        lines.append(f"[dim]compared: {launch_name(compared)}; best warm: {launch_name(snap.best_warm)}[/]")
        basis = launch.basis if launch else snap.basis
        if basis:
            lines.append(f"[dim]prediction: {basis}[/]")
        self.query_one("#registration-summary", Static).update("\n".join(lines))
        per_rank = rank_lines(launch) if launch else []
        ranks = self.query_one("#registration-ranks", Static)
        ranks.display = bool(per_rank)
        ranks.update("\n".join(per_rank))
