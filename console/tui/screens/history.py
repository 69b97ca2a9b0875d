"""`h`: the launch history, newest first: the whole launch's seconds, its registration span
beside the prediction of that span (the Registration pane's figures), paths taken, outcome;
filterable, sortable, Enter for a launch's every phase in full."""

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
from console.data.records import LaunchRecord
from console.tui.screens.detail import DetailScreen
from console.tui.tables import Column, PaneTable, row_of, title

COLUMNS = (
    Column("started", "started", 14, essential=True),
    Column("outcome", "outcome", 8, essential=True),
    Column("total", "total s", 8, essential=True),
    Column("registration", "registration · predicted", 20),
    Column("programs", "programs", 16),
    Column("weights", "weights", 22),
    Column("kv", "kv", 9),
    Column("model", "model", 16),
    Column("host", "host", 10),
    Column("pid", "pid", 7),
    Column("error", "error", 30),
)


def _path(r: LaunchRecord, phase: str) -> str:
    p = r.phase(phase)
    return p.path if p else ""


def registration(r: LaunchRecord) -> str:
    """`3.50 s · 3.00 s`: its registration span and the plan's prediction of the same span, as
    the Registration pane said them ("-" for one it does not have)."""
    if r.registration_seconds is None and r.predicted_registration_seconds is None:
        return ""
    return f"{fmt.secs(r.registration_seconds)} · {fmt.secs(r.predicted_registration_seconds)}"


def row(record: LaunchRecord) -> dict[str, Any]:
    """Its row: what sorts (its start, whole seconds, registration span, each phase's path)
    beside the record."""
    return row_of(record, total=round(record.seconds, 3), registration=record.registration_seconds,
                  **{p: _path(record, p) for p in ("programs", "weights", "kv")})


def cells(row: dict[str, Any]) -> dict[str, str]:
    r: LaunchRecord = row["value"]
    color = "green" if r.outcome == "ok" else "red"
    return {"started": time.strftime("%m-%d %H:%M:%S", time.localtime(r.started or 0)),
            "outcome": f"[{color}]{r.outcome}[/]", "total": fmt.secs(r.seconds),
            "registration": registration(r),
            "programs": _path(r, "programs"), "weights": _path(r, "weights"), "kv": _path(r, "kv"),
            "model": Path(r.model).name, "host": r.host, "pid": str(r.pid if r.pid is not None else ""),
            "error": r.error}


class HistoryScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "close", "Close", id="history.close")]

    def __init__(self, history: list[LaunchRecord]) -> None:
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
