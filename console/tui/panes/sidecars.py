"""Sidecars pane: verdict, residency (and how old the sample is) and what the next launch
does; the progress of a running prepack or warm read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.markup import escape
from textual.app import ComposeResult
from textual.widgets import Static

from console import fmt
from console.data.snapshot import OtherSidecar, SidecarsSnapshot
from console.tui.panes.base import JobLine, Pane
from console.tui.tables import Column, PaneTable, row_of, title
from runtime.launch.plan_report import SidecarPlan

COLUMNS = (
    Column("name", "sidecar", 26, essential=True),
    Column("next_launch", "next launch", 20, essential=True),
    Column("verdict", "verdict", 16, repeats="next_launch"),
    Column("residency", "residency", 10),
    Column("sampled_at", "sampled", 8),
    Column("size_bytes", "size", 9),
)


def rows(snap: SidecarsSnapshot) -> list[dict[str, Any]]:
    """The wanted sidecar first, then the files the next launch does not use."""
    out = [row_of(snap.wanted, name=Path(snap.wanted.path).name, next_launch=snap.wanted.next_launch())] \
        if snap.wanted else []
    return out + [row_of(o, name=Path(o.path).name, next_launch=f"not used (ranks {o.ranks or '?'})")
                  for o in snap.others]


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

    def _cells(self, row: dict[str, Any]) -> dict[str, str]:
        s: SidecarPlan | OtherSidecar = row["value"]
        if isinstance(s, OtherSidecar):
            return {"name": row["name"], "next_launch": f"[yellow]{row['next_launch']}[/]", "verdict": "-",
                    "residency": fmt.bar(None, 4), "sampled_at": fmt.ago(None, self.now),
                    "size_bytes": fmt.size(s.size_bytes) if s.size_bytes else "-"}
        color = "green" if s.mapped else "yellow"
        return {"name": row["name"], "next_launch": f"[{color}]{escape(s.next_launch())}[/]",
                "verdict": s.verdict + (f" ({s.reason})" if s.reason else ""), "residency": fmt.bar(s.residency, 4),
                "sampled_at": fmt.ago(s.sampled_at, self.now),
                "size_bytes": fmt.size(s.size_bytes) if s.size_bytes else "-"}

    def show(self, snap: SidecarsSnapshot, now: float, needle: str = "") -> None:
        self.now = now
        shown, total = self.query_one(PaneTable).set_rows(rows(snap), needle)
        wanted = snap.wanted
        # the title keeps what a collapsed pane (below 120×36) must still say: the verdict and residency
        self.border_title = title("Sidecars", shown, total, needle) + (
            f" · {wanted.residency:.0%} resident" if wanted and wanted.residency is not None else "") + (
            f" · next launch {escape(wanted.next_launch())}" if wanted else "")
        lines = [prepack_line(wanted)] if wanted and wanted.expected_bytes else []
        if wanted and wanted.detail:
            lines.append(escape(f"{Path(wanted.path).name}: {wanted.detail}"))
        text = "\n".join(lines)
        if snap.error:
            text = f"[yellow]{escape(f'{snap.model_dir}: {snap.error}')}[/]"
        self.query_one("#sidecars-reason", Static).update(text)

    def job(self, label: str, done: float | None = None, total: float | None = None) -> None:
        """Show a running prepack or warm read (label empty: hide)."""
        self.query_one(JobLine).show(label, done, total)


def prepack_line(side: SidecarPlan) -> str:
    """What `p` (a prepack) writes, known from the layout before packing: its size against the
    checkpoint's and the disk's free space; red when it would not fit (the prepack refuses)."""
    expected, ckpt, free = side.expected_bytes or 0, side.checkpoint_bytes, side.free_bytes
    ratio = f", {expected / ckpt:.2f}× the checkpoint" if ckpt else ""
    line = f"a prepack writes {fmt.size(expected)}{ratio}"
    if free is None:
        return line
    if side.fits:
        return f"{line}; {fmt.size(free)} free"
    return f"[red]{line}: only {fmt.size(free)} free, p refuses[/]"
