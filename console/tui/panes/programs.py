"""Programs pane: the kernel cache inventory judged against this environment."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.widgets import Static

from console.collectors import ProgramsSnapshot
from console.pane import Pane
from console.tables import Column, PaneTable, title

STATE_STYLE = {"HIT": "green", "MISS": "cyan", "STALE": "yellow", "CORRUPT": "red", "UNTRUSTED": "red",
               "EAGER": "dim"}
COLUMNS = (
    Column("program", "program", 26, essential=True),
    Column("state", "next launch", 11, essential=True),
    Column("fingerprint", "fp", 12),
    Column("reason", "why", 40),
)


class ProgramsPane(Pane):
    """The plan's programs: what the next launch does with each (HIT loads, MISS/STALE/CORRUPT
    compiles) and why; Enter shows the full key's fingerprint, the entry and its manifest."""

    def compose(self) -> ComposeResult:
        yield PaneTable("programs", COLUMNS, self._cells, id="programs-table")
        yield Static(id="programs-totals", classes="totals")

    def on_mount(self) -> None:
        self.border_title = "Programs"

    def _cells(self, e: dict[str, Any]) -> dict[str, str]:
        style = STATE_STYLE.get(e["state"], "")
        return {"program": e["program"], "state": f"[{style}]{e['state']}[/]" if style else e["state"],
                "fingerprint": (e.get("fingerprint") or "")[:12], "reason": e.get("reason") or ""}

    def show(self, snap: ProgramsSnapshot, now: float, needle: str = "") -> None:
        shown, total = self.query_one(PaneTable).set_rows(snap.entries, needle)
        self.border_title = title("Programs", shown, total, needle)
        states = ", ".join(f"{n} {s}" for s, n in snap.totals()["by_state"].items())
        text = (states or "no programs") + f"  [dim]{snap.root}[/]"
        if snap.error:
            text += f"\n[red]{snap.error}[/]"
        elif snap.warning:
            text += f"\n[yellow]{snap.warning}[/]"
        self.query_one("#programs-totals", Static).update(text)
