"""Services pane: every `dsv4 serve` of this user on the host (whoever started it): URL,
model, uptime, health; `s` stops the selected one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.widgets import Static

from console import fmt
from console.collect_services import ServicesSnapshot
from console.pane import Pane
from console.tables import Column, PaneTable, title

COLUMNS = (
    Column("pid", "pid", 7, essential=True),
    Column("url", "url", 22, essential=True),
    Column("health", "health", 9, essential=True),
    Column("create_time", "up", 7),
    Column("model", "model", 18),
    Column("origin", "started by", 10),
)


class ServicesPane(Pane):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.now = 0.0

    def compose(self) -> ComposeResult:
        yield PaneTable("services", COLUMNS, self._cells, id="services-table")
        yield Static(id="services-summary", classes="totals")

    def on_mount(self) -> None:
        self.border_title = "Services"

    def _cells(self, s: dict[str, Any]) -> dict[str, str]:
        color = "green" if s["health"] == "ok" else "yellow"
        health = "-" if s["health"] == s["state"] else s["health"]  # registering: nothing to ask yet
        return {"pid": str(s["pid"]), "url": s["url"] or s["state"], "health": f"[{color}]{health}[/]",
                "create_time": fmt.duration(self.now - s["create_time"]), "model": Path(s["model"]).name,
                "origin": "console" if s["from_console"] else "shell"}

    def show(self, snap: ServicesSnapshot, now: float, needle: str = "") -> None:
        self.now = now
        table = self.query_one(PaneTable)
        shown, total = table.set_rows(snap.services, needle)
        self.border_title = title("Services", shown, total, needle)
        text = ""
        if snap.error:
            text = f"[red]{snap.error}[/]"
        elif not snap.services:
            text = "[dim]no dsv4 serve running on this host (l launches one)[/]"
        else:
            sel = table.selected() or snap.services[0]
            text = f"pid {sel['pid']} {sel['url'] or sel['state']} {sel['health']}  [dim]log[/] {sel['log'] or '-'}"
        self.query_one("#services-summary", Static).update(text)

    def selected(self) -> dict[str, Any] | None:
        return self.query_one(PaneTable).selected()
