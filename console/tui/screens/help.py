"""`?`: every key of the console, read from the app's bindings (one source of truth)."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

# keys that are not the console's own bindings (the table's, Textual's)
EXTRA = (
    ("enter", "details", "the selected row in full (path, fingerprint, manifest, why)"),
    ("tab", "next pane", "move focus; in a small terminal the focused pane expands"),
    ("ctrl+p", "palette", "every action by name"),
    ("ctrl+q", "quit", "the same as q"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark", "dismiss_help", "Close",
                                                     id="help.close")]

    def __init__(self, bindings: list[Binding], mutating: frozenset[str], readonly: bool,
                 title: str = "dsv4-console keys", extra: tuple[tuple[str, str, str], ...] = EXTRA) -> None:
        super().__init__()
        self.keys, self.mutating, self.readonly, self.title_text = bindings, mutating, readonly, title
        self.extra = extra

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help"):
            mode = " — read-only: actions marked ✎ are refused" if self.readonly else ""
            yield Static(f"[b]{self.title_text}[/]{mode}", id="help-title")
            # a rich table, not a DataTable: the last column wraps in a narrow terminal instead of being cut
            table = Table(box=None, expand=True, header_style="bold", pad_edge=False)
            table.add_column("key", no_wrap=True)
            table.add_column("action", no_wrap=True)
            table.add_column("", no_wrap=True)
            table.add_column("what it does", ratio=1)
            for b in self.keys:
                mark = "✎" if b.id in self.mutating else ""
                table.add_row(b.key_display or b.key, b.id or b.action, mark, b.tooltip or b.description)
            for key, action, what in self.extra:
                table.add_row(key, action, "", what)
            yield Static(table, id="help-table")
            yield Static("[dim]esc / q / ? to close[/]", id="help-foot")

    def action_dismiss_help(self) -> None:
        self.dismiss(None)
