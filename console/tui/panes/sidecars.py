"""Sidecars pane: verdict, residency (and how old the sample is) and what the next launch
does; the progress of a running prepack or warm read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from textual.app import ComposeResult
from textual.widgets import Static

from console import fmt
from console.data.collectors import SidecarsSnapshot
from console.tui.panes.base import JobLine, Pane
from console.tui.tables import Column, PaneTable, title
from store.sidecar.verdict import MAP

COLUMNS = (
    Column("name", "sidecar", 26, essential=True),
    Column("next_launch", "next launch", 20, essential=True),
    Column("verdict", "verdict", 16, repeats="next_launch"),
    Column("residency", "residency", 10),
    Column("sampled_at", "sampled", 8),
    Column("size_bytes", "size", 9),
)


class SidecarsPane(Pane):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.now = 0.0

    def compose(self) -> ComposeResult:
        yield PaneTable("sidecars", COLUMNS, self._cells, id="sidecars-table")
        yield Static(id="sidecars-reason", classes="totals")
        yield JobLine(id="sidecars-job")

    def on_mount(self) -> None:
        self.border_title = "Sidecars"

    def _cells(self, s: dict[str, Any]) -> dict[str, str]:
        color = "green" if s["verdict"] == MAP else "yellow"
        verdict = s["verdict"] + (f" ({s['reason']})" if s["reason"] else "")
        return {"name": Path(s["path"]).name, "next_launch": f"[{color}]{s['next_launch']}[/]",
                "verdict": verdict, "residency": fmt.bar(s["residency"], 4),
                "sampled_at": fmt.ago(s["sampled_at"], self.now),
                "size_bytes": fmt.size(s["size_bytes"]) if s["size_bytes"] else "-"}

    def show(self, snap: SidecarsSnapshot, now: float, needle: str = "") -> None:
        self.now = now
        rows = [{**s, "name": Path(s["path"]).name} for s in snap.sidecars]
        shown, total = self.query_one(PaneTable).set_rows(rows, needle)
        wanted = next((r for r in rows if r.get("wanted")), None)
        # the title keeps what a collapsed pane (below 120×36) must still say: the verdict and residency
        self.border_title = title("Sidecars", shown, total, needle) + (
            f" · {wanted['residency']:.0%} resident" if wanted and wanted.get("residency") is not None else "") + (
            f" · next launch {wanted['next_launch']}" if wanted else "")
        reasons = [f"{Path(s['path']).name}: {s['detail']}" for s in snap.sidecars if s.get("detail")]
        text = "\n".join(([prepack_line(wanted)] if wanted and wanted.get("expected_bytes") else []) + reasons)
        if snap.error:
            text = f"[yellow]{snap.model_dir}: {snap.error}[/]"
        self.query_one("#sidecars-reason", Static).update(text)

    def job(self, label: str, done: float | None = None, total: float | None = None) -> None:
        """Show a running prepack or warm read (label empty: hide)."""
        self.query_one(JobLine).show(label, done, total)


def prepack_line(side: dict[str, Any]) -> str:
    """What `p` (a prepack) writes, known from the layout before packing: its size against the
    checkpoint's and the disk's free space; red when it would not fit (the prepack refuses)."""
    expected, ckpt, free = side["expected_bytes"], side.get("checkpoint_bytes"), side.get("free_bytes")
    ratio = f", {expected / ckpt:.2f}× the checkpoint" if ckpt else ""
    line = f"a prepack writes {fmt.size(expected)}{ratio}"
    if free is None:
        return line
    if side.get("fits", True):
        return f"{line}; {fmt.size(free)} free"
    return f"[red]{line}: only {fmt.size(free)} free, p refuses[/]"
