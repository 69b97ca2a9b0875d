"""Sidecars pane: verdict, residency and what the next launch does; prepack/warm progress."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, ProgressBar, Static

from console import fmt
from console.collectors import SidecarsSnapshot


class SidecarsPane(Vertical):
    def compose(self) -> ComposeResult:
        table = DataTable(id="sidecars-table", cursor_type="row")
        table.add_columns("sidecar", "size", "verdict", "residency", "sampled", "next launch")
        yield table
        yield Static(id="sidecars-reason", classes="totals")
        yield Static(id="sidecars-job", classes="job")
        yield ProgressBar(id="sidecars-progress", show_eta=False)

    def on_mount(self) -> None:
        self.border_title = "Sidecars"
        self.query_one(ProgressBar).display = False

    def show(self, snap: SidecarsSnapshot, now: float, needle: str = "") -> None:
        table = self.query_one(DataTable)
        table.clear()
        reasons = []
        for s in snap.sidecars:
            verdict = s["verdict"] + (f" ({s['reason']})" if s["reason"] else "")
            cells = (Path(s["path"]).name, fmt.size(s["size_bytes"]) if s["size_bytes"] else "-", verdict,
                     fmt.bar(s["residency"], 10), fmt.ago(s["sampled_at"], now), s["next_launch"])
            if needle and not any(needle in c.lower() for c in cells):
                continue
            color = "green" if s["verdict"] == "MAP" else "yellow"
            table.add_row(cells[0], cells[1], f"[{color}]{verdict}[/]", *cells[3:])
            if s.get("detail"):
                reasons.append(f"{Path(s['path']).name}: {s['detail']}")
        text = "\n".join(reasons) or ""
        if snap.error:
            text = f"[yellow]{snap.model_dir}: {snap.error}[/]"
        self.query_one("#sidecars-reason", Static).update(text)

    def job(self, label: str, done: float | None = None, total: float | None = None) -> None:
        """Show a running prepack/warm (label empty: hide)."""
        bar = self.query_one(ProgressBar)
        self.query_one("#sidecars-job", Static).update(label)
        bar.display = bool(label)
        if label:
            bar.update(total=total or None, progress=done or 0)
