"""Registration pane: each phase's progress, seconds and path; the previous launch and the
best warm one from the launch history; before a launch, the predicted path of each phase."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from console import fmt
from console.collectors import RegistrationSnapshot, launch_seconds
from console.launch_state import DONE, FAILED, RUNNING, LaunchState, path_taken
from runtime.events import PHASES

STATE_MARK = {DONE: "[green]✓[/]", FAILED: "[red]✗[/]", RUNNING: "[yellow]…[/]"}


def _past(record: dict[str, Any] | None, phase: str) -> str:
    if not record:
        return "-"
    p = record.get("phases", {}).get(phase)
    if not p:
        return "-"
    if "error" in p:
        return f"{fmt.secs(p.get('seconds'))} error"
    path = path_taken(phase, p)
    return f"{fmt.secs(p.get('seconds'))} {path}".strip()


class RegistrationPane(Vertical):
    def compose(self) -> ComposeResult:
        table = DataTable(id="registration-table", cursor_type="none")
        # fixed widths: auto-sized columns keep the width of the first (empty) rows they saw
        for label, width in (("phase", 10), ("progress", 10), ("now", 8), ("path", 18), ("predicted", 22),
                             ("previous", 9), ("best warm", 9)):
            table.add_column(label, width=width)
        yield table
        yield Static(id="registration-summary", classes="totals")

    def on_mount(self) -> None:
        self.border_title = "Registration"

    def show(self, snap: RegistrationSnapshot, launch: LaunchState | None, status: str = "") -> None:
        table = self.query_one(DataTable)
        table.clear()
        previous = snap.previous
        if launch and previous and previous.get("started", 0) >= launch.spawned:
            previous = snap.earlier  # the last record is this launch: compare with the one before
        for phase in PHASES:
            p = launch.phases[phase] if launch else None
            mark = STATE_MARK.get(p.state, " ") if p else " "
            table.add_row(f"{mark} {phase}", fmt.bar(p.fraction if p else 0.0, 10),
                          fmt.secs(p.seconds) if p else "-", (p.path if p else "")[:40],
                          snap.prediction.get(phase, ""), _past(previous, phase),
                          _past(snap.best_warm, phase))
        parts = []
        if launch:
            parts.append(f"this launch {launch.total_seconds:.2f} s")
            if launch.url:
                parts.append(f"[green]serving {launch.url}[/]")
            if launch.error:
                parts.append(f"[red]{launch.error}[/]")
        if previous:
            parts.append(f"previous {launch_seconds(previous):.2f} s ({previous.get('outcome')})")
        if snap.best_warm:
            parts.append(f"best warm {launch_seconds(snap.best_warm):.2f} s")
        if status:
            parts.append(status)
        if snap.basis:
            parts.append(f"[dim]prediction: {snap.basis}[/]")
        self.query_one("#registration-summary", Static).update("  ".join(parts))
