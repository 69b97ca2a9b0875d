"""The base of every pane: a bordered box that `z` can maximise and the compact layout
collapses to its title and one summary line; and the progress line of a job a pane runs."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import ProgressBar, Static


class Pane(Vertical):
    ALLOW_MAXIMIZE: ClassVar[bool | None] = True

    def __init__(self, **kw: Any) -> None:
        super().__init__(classes="pane", **kw)


class JobLine(Vertical):
    """A running job's progress line and bar (prepack, warm, compile); hidden while none runs."""

    # one line and the bar: the pane's table keeps its rows (the log has every line in full)
    DEFAULT_CSS = """
    JobLine { height: auto; }
    JobLine > Static { height: 1; text-wrap: nowrap; text-overflow: ellipsis; }
    JobLine > ProgressBar { height: 1; }
    """

    def compose(self) -> ComposeResult:
        yield Static()
        yield ProgressBar(show_eta=False)

    def on_mount(self) -> None:
        self.display = False

    def show(self, label: str, done: float | None = None, total: float | None = None) -> None:
        """Show a job's line (label empty: hide); the bar while its total is known."""
        self.display = bool(label)
        self.query_one(Static).update(label)
        bar = self.query_one(ProgressBar)
        bar.display = bool(label) and bool(total)
        if label:
            bar.update(total=total or None, progress=done or 0)
