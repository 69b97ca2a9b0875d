"""Log pane: worker log lines, following the tail, filtered by `/`."""

from __future__ import annotations

from collections import deque

from rich.markup import escape
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import RichLog

MAX_LINES = 2000


class LogPane(Vertical):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.lines: deque[tuple[str, str]] = deque(maxlen=MAX_LINES)  # (source, text)
        self.needle = ""

    def compose(self) -> ComposeResult:
        yield RichLog(id="log", max_lines=MAX_LINES, wrap=True, markup=True, auto_scroll=True)

    def on_mount(self) -> None:
        self.border_title = "Log"

    def _markup(self, source: str, text: str) -> str:
        color = {"error": "red", "console": "cyan"}.get(source, "dim")
        return f"[{color}]{escape(source)}[/] {escape(text)}"

    def add(self, source: str, text: str) -> None:
        self.lines.append((source, text))
        if not self.needle or self.needle in f"{source} {text}".lower():
            self.query_one(RichLog).write(self._markup(source, text))

    def filter(self, needle: str) -> None:
        self.needle = needle
        log = self.query_one(RichLog)
        log.clear()
        for source, text in self.lines:
            if not needle or needle in f"{source} {text}".lower():
                log.write(self._markup(source, text))
        self.border_subtitle = f"filter: {needle}" if needle else ""
