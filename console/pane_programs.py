"""Programs pane: the program cache inventory judged against this environment."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.widgets import Static

from console import fmt
from console.collectors import ProgramsSnapshot
from console.pane import Pane
from console.tables import Column, PaneTable, title

STATE_STYLE = {"current": "green", "other-layout": "cyan", "stale": "yellow", "corrupt": "red", "partial": "magenta"}
COLUMNS = (
    Column("program", "program", 22, essential=True),
    Column("state", "state", 14, essential=True),
    Column("fingerprint", "fp", 12),
    Column("size_bytes", "size", 9),
    Column("last_used", "last used", 9),
    Column("hits", "hits", 5),
    Column("reason", "why", 30),
)


class ProgramsPane(Pane):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.now = 0.0

    def compose(self) -> ComposeResult:
        yield PaneTable("programs", COLUMNS, self._cells, sort_key="program", id="programs-table")
        yield Static(id="programs-totals", classes="totals")

    def on_mount(self) -> None:
        self.border_title = "Programs"

    def _cells(self, e: dict[str, Any]) -> dict[str, str]:
        style = STATE_STYLE.get(e["state"], "")
        return {"program": e["program"], "state": f"[{style}]{e['state']}[/]" if style else e["state"],
                "fingerprint": e["fingerprint"][:12], "size_bytes": fmt.size(e["size_bytes"]),
                "last_used": fmt.ago(e["last_used"], self.now) if e["hits"] else "never", "hits": str(e["hits"]),
                "reason": e.get("reason") or ""}

    def show(self, snap: ProgramsSnapshot, now: float, needle: str = "") -> None:
        self.now = now
        shown, total = self.query_one(PaneTable).set_rows(snap.entries, needle)
        self.border_title = title("Programs", shown, total, needle, "entries")
        t = snap.totals()
        states = ", ".join(f"{n} {s}" for s, n in t["by_state"].items())
        text = f"{fmt.size(t['size_bytes'])}" + (f" ({states})" if states else "") + f"  [dim]{snap.root}[/]"
        if snap.error:
            text += f"\n[red]{snap.error}[/]"
        elif snap.warning:
            text += f"\n[yellow]{snap.warning}[/]"
        self.query_one("#programs-totals", Static).update(text)
