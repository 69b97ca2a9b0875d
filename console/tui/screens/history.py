"""`h`: the launch history, newest first: phase seconds, paths taken, outcome; filterable,
sortable, Enter for a launch's every phase in full."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static

from console import fmt
from console.data.collectors import launch_seconds
from console.data.launch_state import path_taken
from console.tui.screens.detail import DetailScreen
from console.tui.tables import Column, PaneTable, title

COLUMNS = (
    Column("started", "started", 14, essential=True),
    Column("outcome", "outcome", 8, essential=True),
    Column("total", "total s", 8, essential=True),
    Column("programs", "programs", 16),
    Column("weights", "weights", 22),
    Column("kv", "kv", 9),
    Column("model", "model", 16),
    Column("host", "host", 10),
    Column("pid", "pid", 7),
    Column("error", "error", 30),
)


def row(record: dict[str, Any]) -> dict[str, Any]:
    phases = record.get("phases", {})
    return {**record, "total": round(launch_seconds(record), 3),
            **{p: path_taken(p, phases.get(p, {})) for p in ("programs", "weights", "kv")}}


def cells(r: dict[str, Any]) -> dict[str, str]:
    color = "green" if r.get("outcome") == "ok" else "red"
    return {"started": time.strftime("%m-%d %H:%M:%S", time.localtime(r.get("started") or 0)),
            "outcome": f"[{color}]{r.get('outcome')}[/]", "total": fmt.secs(r["total"]),
            "programs": r["programs"], "weights": r["weights"], "kv": r["kv"],
            "model": Path(str(r.get("model", ""))).name, "host": str(r.get("host", "")), "pid": str(r.get("pid", "")),
            "error": str(r.get("error") or "")}


class HistoryScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "close", "Close", id="history.close")]

    def __init__(self, history: list[dict[str, Any]]) -> None:
        super().__init__()
        self.rows = [row(r) for r in history]

    def compose(self) -> ComposeResult:
        with Vertical(id="history"):
            yield Static(id="history-title")
            yield Input(placeholder="filter launches (model, outcome, path, error…)", id="history-filter")
            yield PaneTable("history", COLUMNS, cells, sort_key="started", reverse=True, id="history-table")
            yield Static("[dim]enter: every phase · o/O: sort · esc: close[/]")

    def on_mount(self) -> None:
        self._show("")
        self.query_one(PaneTable).focus()

    def _show(self, needle: str) -> None:
        shown, total = self.query_one(PaneTable).set_rows(self.rows, needle)
        self.query_one("#history-title", Static).update(f"[b]{title('Launches', shown, total, needle)}[/]")

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self._show(event.value.strip().lower())

    def on_pane_table_chosen(self, message: PaneTable.Chosen) -> None:
        message.stop()
        self.app.push_screen(DetailScreen("launch", message.row))

    def action_close(self) -> None:
        self.dismiss(None)
