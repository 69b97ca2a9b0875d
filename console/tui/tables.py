"""One table behaviour for every pane (k9s/nvitop habits): columns that fit the pane's width
(essential ones always stay; the last one shown takes what width is left, so text is never cut
while space sits empty; a column whose every cell repeats another's is hidden), sorting by any
column (`o` cycles, `O` reverses, or click a header; a column may rank its values, so problems
sort first), the `/` filter, and "n of m" for the pane's title. Panes give rows as dicts and a
function that renders a row's cells; Enter on a row posts the row's dict for a detail view.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from rich.cells import cell_len
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
    repeats: str = ""  # another column's key: hidden while every row's cell here opens that one's (or is empty)
    rank: Mapping[str, int] | None = None  # sort order of this column's values (unranked ones last)


GAP = 2  # DataTable pads each cell by one on both sides
MARK = 2  # " ▲": the sort column's header mark


def fit(columns: Sequence[Column], width: int, wants: Mapping[str, int] | None = None) -> list[Column]:
    """The columns that fit `width` cells. A column needs its declared width, or less where its
    header and every cell (`wants`: the widest, by key) are narrower; essential columns come
    first, then the others in order while they fit. Width left over goes to the columns whose
    text is cut, in order, and what remains to the last column shown."""
    wants = wants or {}

    def need(c: Column) -> int:
        return min(c.width, wants[c.key]) if c.key in wants else c.width

    chosen = {c.key for c in columns if c.essential}
    used = sum(need(c) + GAP for c in columns if c.essential)
    for c in columns:
        if c.key not in chosen and used + need(c) + GAP <= width:
            chosen.add(c.key)
            used += need(c) + GAP
    out = [replace(c, width=need(c)) for c in columns if c.key in chosen]
    spare = width - used
    for i, c in enumerate(out):
        more = min(spare, wants.get(c.key, 0) - c.width)
        if more > 0:
            out[i], spare = replace(c, width=c.width + more), spare - more
    if out and spare > 0:
        out[-1] = replace(out[-1], width=out[-1].width + spare)
    return out


def _plain(cell: Any) -> str:
    if isinstance(cell, Text):
        return cell.plain
    cell = str(cell)
    return Text.from_markup(cell).plain if "[" in cell else cell


def _repeated(cell: str, other: str) -> bool:
    """Nothing here that the other column does not say first (`MAP` beside `MAP (cold: …)`)."""
    return cell in ("", "-") or other.startswith(cell)


def _wants(spec: Sequence[Column], rows: Sequence[dict[str, Any]], sort_key: str | None) -> dict[str, int]:
    """Each column's widest text: its header (with the sort mark) or a cell."""
    return {c.key: max([cell_len(c.label) + (MARK if c.key == sort_key else 0),
                        *(cell_len(_plain(cells.get(c.key, ""))) for cells in rows)]) for c in spec}


def _sort_value(value: Any, rank: Mapping[str, int] | None = None) -> tuple[int, Any]:
    if rank is not None:
        return (0, rank.get(str(value), len(rank)))
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
        self._fitted: tuple[tuple[str, int], ...] = ()  # (key, width) of the columns shown
        self._rendered: list[tuple] = []  # the cells shown, row by row

    def on_resize(self) -> None:
        self.render_rows()

    def set_rows(self, rows: Sequence[dict[str, Any]], needle: str = "") -> tuple[int, int]:
        """Show `rows` (filtered, sorted, fitted); returns (shown, total) for the title."""
        self.rows_all, self.needle = list(rows), needle
        self.render_rows()
        return len(self.rows_shown), len(self.rows_all)

    def render_rows(self) -> None:
        shown = []
        for row in self.rows_all:
            cells = self.cells(row)
            if self.needle and not any(self.needle in str(v).lower() for v in cells.values()):
                continue
            shown.append((row, cells))
        spec = [c for c in self.spec if not (c.repeats and shown and all(
            _repeated(_plain(cells.get(c.key, "")), _plain(cells.get(c.repeats, ""))) for _, cells in shown))]
        columns = fit(spec, self._width(), _wants(spec, [cells for _, cells in shown], self.sort_key))
        fitted = tuple((c.key, c.width) for c in columns)
        keys = tuple(c.key for c in columns)
        if self.sort_key:
            rank = next((c.rank for c in self.spec if c.key == self.sort_key), None)
            shown.sort(key=lambda rc: _sort_value(rc[0].get(self.sort_key, str(rc[1].get(self.sort_key, ""))), rank),
                       reverse=self.reverse)
        rendered = [tuple(cells.get(k, "") for k in keys) for _, cells in shown]
        if fitted == self._fitted and len(rendered) == len(self._rendered) == self.row_count:
            # the same columns and as many rows: repaint only the cells that changed (a refresh of an
            # idle console changes a few figures, and a whole table's rebuild is most of its CPU)
            for i, (new, old) in enumerate(zip(rendered, self._rendered, strict=True)):
                for key, a, b in zip(keys, new, old, strict=True):
                    if a != b:
                        self.update_cell(str(i), key, a)
            self.rows_shown, self._rendered = [r for r, _ in shown], rendered
            return
        cursor = self.cursor_row
        if fitted != self._fitted:
            self.clear(columns=True)
            for c in columns:
                label = c.label + (" ▼" if c.key == self.sort_key and self.reverse else
                                   " ▲" if c.key == self.sort_key else "")
                self.add_column(label, width=c.width, key=c.key)
            self._fitted = fitted
        else:
            self.clear()
        self.rows_shown, self._rendered = [r for r, _ in shown], rendered
        for i, cells in enumerate(rendered):
            self.add_row(*cells, key=str(i))
        if self.row_count:
            self.move_cursor(row=min(cursor, self.row_count - 1))

    def _width(self) -> int:
        """The cells' width: the table's, less a vertical scrollbar when the rows overflow."""
        if not self.size.width:
            return 200  # not laid out yet (a snapshot before the first paint)
        bar = self.styles.scrollbar_size_vertical if len(self.rows_all) >= self.size.height else 0
        return max(1, self.size.width - bar)

    def selected(self) -> dict[str, Any] | None:
        if 0 <= self.cursor_row < len(self.rows_shown):
            return self.rows_shown[self.cursor_row]
        return None

    def _resort(self, key: str | None, reverse: bool) -> None:
        self.sort_key, self.reverse = key, reverse
        self._fitted = ()  # relabel the headers
        self.render_rows()

    def action_sort_next(self) -> None:
        keys = [k for k, _ in self._fitted] or [c.key for c in self.spec]  # the columns shown
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


def row_of(value: Any, **extra: Any) -> dict[str, Any]:
    """A table's row for a typed value: its JSON form (what sorts, filters and the details view
    show) and the value itself under `value` (what the cells and the actions read)."""
    return {**value.to_json(), **extra, "value": value}


def title(name: str, shown: int, total: int, needle: str, noun: str = "") -> str:
    """A pane's title: `Programs 13` or, filtered, `Programs 2 of 13 /stale`."""
    if needle:
        return f"{name} {shown} of {total} [dim]/{needle}[/]"
    return f"{name} {total}{' ' + noun if noun else ''}"
