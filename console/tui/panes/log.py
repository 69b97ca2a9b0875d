"""Log pane: worker log lines wrapped to the pane's width, following the tail only while the
view is at the bottom (reading above is never interrupted), filtered by `/`, saved by ctrl+s."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

from rich.markup import escape
from textual.app import ComposeResult
from textual.widgets import RichLog

from console.tui.panes.base import Pane

MAX_LINES = 2000
MIN_WRAP = 20  # narrower than this the pane is hidden (another pane zoomed) or collapsed: wrap later


class LogPane(Pane):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.lines: deque[tuple[float, str, str]] = deque(maxlen=MAX_LINES)  # (time, source, text)
        self.needle = ""
        self._width = 0
        self._stale = False  # lines came while the pane was too narrow to wrap them: redraw once it is not

    def compose(self) -> ComposeResult:
        # min_width 1: RichLog otherwise renders every line at least 78 cells wide
        yield RichLog(id="log", max_lines=MAX_LINES, wrap=True, markup=True, auto_scroll=False, min_width=1)

    def on_mount(self) -> None:
        self.border_title = "Log"
        # a zoom hides the pane without resizing it, and ending one shows it without a resize or a
        # Show event: the screen's `maximized` is what says so
        self.watch(self.screen, "maximized", lambda _: self.call_after_refresh(self._rewrap), init=False)

    def on_resize(self) -> None:
        self._rewrap()

    def _rewrap(self) -> None:
        log = self.query_one(RichLog)
        width = log.scrollable_content_region.width
        if width < MIN_WRAP:
            return
        if width != self._width or self._stale:
            self._width, self._stale = width, False
            self._redraw()  # re-wrap to the new width

    @staticmethod
    def _wrap_width(log: RichLog) -> int | None:
        """The pane's own width (RichLog would measure against the app console's 80 columns)."""
        return log.scrollable_content_region.width or None

    def _markup(self, source: str, text: str) -> str:
        color = {"error": "red", "console": "cyan"}.get(source, "dim")
        return f"[{color}]{escape(source)}[/] {escape(text)}"

    def _matches(self, source: str, text: str) -> bool:
        return not self.needle or self.needle in f"{source} {text}".lower()

    def add(self, source: str, text: str) -> None:
        self.lines.append((time.time(), source, text))
        if not self._matches(source, text):
            return
        log = self.query_one(RichLog)
        if log.scrollable_content_region.width < MIN_WRAP:  # hidden: a line wrapped now would be a letter a row
            self._stale = True
            return
        log.write(self._markup(source, text), width=self._wrap_width(log), scroll_end=log.is_vertical_scroll_end)

    def _redraw(self) -> None:
        log = self.query_one(RichLog)
        if log.scrollable_content_region.width < MIN_WRAP:
            self._stale = True  # when it shows again
            return
        at_end = log.is_vertical_scroll_end
        log.clear()
        for _, source, text in self.lines:
            if self._matches(source, text):
                log.write(self._markup(source, text), width=self._wrap_width(log), scroll_end=False)
        if at_end:
            log.scroll_end(animate=False, immediate=False)

    def filter(self, needle: str) -> None:
        self.needle = needle
        self._redraw()
        shown = sum(self._matches(s, t) for _, s, t in self.lines)
        self.border_title = f"Log {shown} of {len(self.lines)} [dim]/{needle}[/]" if needle else "Log"

    def save(self) -> Path | None:
        """Every line (unfiltered) to `<state dir>/logs/console-<time>.log`; its path."""
        from store.paths import state_dir

        path = state_dir() / "logs" / time.strftime("console-%Y%m%d-%H%M%S.log")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for t, source, text in self.lines:
                f.write(f"{time.strftime('%H:%M:%S', time.localtime(t))} {source} {text}\n")
        return path
