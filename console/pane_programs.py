"""Programs pane: the program cache inventory judged against this environment."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from console import fmt
from console.collectors import ProgramsSnapshot

STATE_STYLE = {"current": "green", "other-layout": "cyan", "stale": "yellow", "corrupt": "red", "partial": "magenta"}


class ProgramsPane(Vertical):
    def compose(self) -> ComposeResult:
        table = DataTable(id="programs-table", cursor_type="row", zebra_stripes=True)
        table.add_columns("program", "fp", "state", "size", "last used", "hits")
        yield table
        yield Static(id="programs-totals", classes="totals")

    def on_mount(self) -> None:
        self.border_title = "Programs"

    def show(self, snap: ProgramsSnapshot, now: float, needle: str = "") -> None:
        table = self.query_one(DataTable)
        row = table.cursor_row
        table.clear()
        for e in snap.entries:
            state = e["state"] + (f": {e['reason']}" if e["state"] == "stale" and e["reason"] else "")
            cells = (e["program"], e["fingerprint"][:12], state, fmt.size(e["size_bytes"]),
                     fmt.ago(e["last_used"], now) if e["hits"] else "never", str(e["hits"]))
            if needle and not any(needle in c.lower() for c in cells):
                continue
            style = STATE_STYLE.get(e["state"], "")
            table.add_row(*cells[:2], f"[{style}]{state}[/]" if style else state, *cells[3:])
        if table.row_count:
            table.move_cursor(row=min(row, table.row_count - 1))
        t = snap.totals()
        states = ", ".join(f"{n} {s}" for s, n in t["by_state"].items())
        text = f"{t['entries']} entries, {fmt.size(t['size_bytes'])}" + (f" ({states})" if states else "")
        text += f"  [dim]{snap.root}[/]"
        if snap.error:
            text += f"\n[red]{snap.error}[/]"
        elif snap.warning:
            text += f"\n[yellow]{snap.warning}[/]"
        self.query_one("#programs-totals", Static).update(text)
