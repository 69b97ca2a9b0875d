"""One table behaviour for every pane (k9s/nvitop habits): columns that fit the pane's width
(essential ones always stay), sorting by any column (`o` cycles, `O` reverses, or click a
header), the `/` filter, and "n of m" for the pane's title. Panes give rows as dicts and a
function that renders a row's cells; Enter on a row posts the row's dict for a detail view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.text import Text
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import DataTable


@dataclass(frozen=True)
class Column:
    key: str  # the row's key: what the column shows and sorts by
    label: str
    width: int
    essential: bool = False  # kept however narrow the pane


def fit(columns: Sequence[Column], width: int) -> list[Column]:
    """The columns that fit `width` cells: essential ones first, then the others in order."""
    gap = 2  # DataTable pads each cell by one on both sides
    chosen = {c.key for c in columns if c.essential}
    used = sum(c.width + gap for c in columns if c.essential)
    for c in columns:
        if c.key not in chosen and used + c.width + gap <= width:
            chosen.add(c.key)
            used += c.width + gap
    return [c for c in columns if c.key in chosen]


def _sort_value(value: Any) -> tuple[int, Any]:
    if value is None:
        return (2, "")
    if isinstance(value, bool | int | float):
        return (0, value)
    return (1, str(value).lower())


Cells = Callable[[dict[str, Any]], dict[str, str | Text]]


class PaneTable(DataTable):
    """A DataTable over row dicts; see the module docstring."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("o", "sort_next", "Sort", id="sort", show=False, tooltip="sort the focused table by the next column"),
        Binding("O", "sort_reverse", "Reverse", id="sort.reverse", show=False,
                tooltip="reverse the focused table's order"),
    ]

    class Chosen(Message):
        """Enter on a row: the pane's name and the row's dict, for a detail view."""

        def __init__(self, pane: str, row: dict[str, Any]) -> None:
            super().__init__()
            self.pane, self.row = pane, row

    def __init__(self, pane: str, columns: Sequence[Column], cells: Cells, *, sort_key: str | None = None,
                 reverse: bool = False, **kw: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self.pane, self.spec, self.cells = pane, tuple(columns), cells
        self.sort_key, self.reverse = sort_key, reverse
        self.rows_all: list[dict[str, Any]] = []
        self.rows_shown: list[dict[str, Any]] = []
        self.needle = ""
        self._fitted: tuple[str, ...] = ()

    def on_resize(self) -> None:
        self.render_rows()

    def set_rows(self, rows: Sequence[dict[str, Any]], needle: str = "") -> tuple[int, int]:
        """Show `rows` (filtered, sorted, fitted); returns (shown, total) for the title."""
        self.rows_all, self.needle = list(rows), needle
        self.render_rows()
        return len(self.rows_shown), len(self.rows_all)

    def render_rows(self) -> None:
        columns = fit(self.spec, max(self.size.width, 1) if self.size.width else 200)
        keys = tuple(c.key for c in columns)
        cursor = self.cursor_row
        if keys != self._fitted:
            self.clear(columns=True)
            for c in columns:
                label = c.label + (" ▼" if c.key == self.sort_key and self.reverse else
                                   " ▲" if c.key == self.sort_key else "")
                self.add_column(label, width=c.width, key=c.key)
            self._fitted = keys
        else:
            self.clear()
        shown = []
        for row in self.rows_all:
            cells = self.cells(row)
            if self.needle and not any(self.needle in str(v).lower() for v in cells.values()):
                continue
            shown.append((row, cells))
        if self.sort_key:
            shown.sort(key=lambda rc: _sort_value(rc[0].get(self.sort_key, str(rc[1].get(self.sort_key, "")))),
                       reverse=self.reverse)
        self.rows_shown = [r for r, _ in shown]
        for _, cells in shown:
            self.add_row(*(cells.get(k, "") for k in keys))
        if self.row_count:
            self.move_cursor(row=min(cursor, self.row_count - 1))

    def selected(self) -> dict[str, Any] | None:
        if 0 <= self.cursor_row < len(self.rows_shown):
            return self.rows_shown[self.cursor_row]
        return None

    def _resort(self, key: str | None, reverse: bool) -> None:
        self.sort_key, self.reverse = key, reverse
        self._fitted = ()  # relabel the headers
        self.render_rows()

    def action_sort_next(self) -> None:
        keys = [c.key for c in fit(self.spec, self.size.width or 200)]
        nxt = keys[(keys.index(self.sort_key) + 1) % len(keys)] if self.sort_key in keys else keys[0]
        self._resort(nxt, self.reverse)

    def action_sort_reverse(self) -> None:
        self._resort(self.sort_key or self.spec[0].key, not self.reverse)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        key = str(event.column_key.value)
        self._resort(key, not self.reverse if key == self.sort_key else False)
        event.stop()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        row = self.selected()
        if row is not None:
            self.post_message(self.Chosen(self.pane, row))


def title(name: str, shown: int, total: int, needle: str, noun: str = "") -> str:
    """A pane's title: `Programs 13` or, filtered, `Programs 2 of 13 /stale`."""
    if needle:
        return f"{name} {shown} of {total} [dim]/{needle}[/]"
    return f"{name} {total}{' ' + noun if noun else ''}"
