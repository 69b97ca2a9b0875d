"""Services pane: every `dsv4 serve` of this user on the host (whoever started it): URL,
model, uptime, health; `s` stops the selected one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.widgets import Static

from console.tui import fmt
from console.tui.data.services import ServicesSnapshot
from console.tui.panes.base import Pane
from console.tui.tables import Column, PaneTable, title

COLUMNS = (  # which service it is first (two of one model differ by who started them), then how it does
    Column("pid", "pid", 7, essential=True),
    Column("url", "url", 21, essential=True),
    Column("health", "health", 7, essential=True),
    Column("origin", "by", 7),
    Column("model", "model", 12),
    Column("create_time", "up", 6),
    Column("engine", "engine", 16),
)


def engine_cell(engine: dict[str, Any]) -> str:
    """"batch 12.4 · mtp 61%": the mean decode batch, and the MTP acceptance when it drafts."""
    if not engine.get("steps"):
        return "-"
    text = f"batch {engine.get('mean_batch', 0):g}"
    if engine.get("acceptance") is not None:
        text += f" · mtp {engine['acceptance']:.0%}"
    return text


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
        url = s["url"].removeprefix("http://") if s["url"] else s["state"]  # the summary line has the full URL
        return {"pid": str(s["pid"]), "url": url, "health": f"[{color}]{health}[/]",
                "engine": engine_cell(s.get("engine") or {}),
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
