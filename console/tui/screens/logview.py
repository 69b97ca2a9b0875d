"""A service's log, as k9s's `l` shows a pod's: its last lines, then the tail as it grows
(followed only while the view is at the bottom), wrapped to the width, `/` to search (enter
jumps to the next match, `n` again), and the service's other logs — each rank's — one key away
(`tab`, or its number)."""

from __future__ import annotations

import os
import stat
from typing import ClassVar

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, RichLog, Static

TAIL_BYTES = 256 << 10  # what opening a log shows of its past
POLL_S = 0.5
MAX_LINES = 5000


def read_from(path: str, offset: int | None) -> tuple[list[str], int]:
    """The complete lines of a regular file from `offset` (None: its last TAIL_BYTES), and the
    offset after them; never blocks on a FIFO, never follows a file that is not regular."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return [], offset or 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return [], offset or 0
        start = max(0, st.st_size - TAIL_BYTES) if offset is None else min(offset, st.st_size)
        data = os.pread(fd, min(st.st_size - start, 4 * TAIL_BYTES), start)
    finally:
        os.close(fd)
    end = data.rfind(b"\n") + 1  # a line still being written waits for its end
    lines = data[:end].decode(errors="replace").splitlines()
    if offset is None and start > 0 and lines:
        lines = lines[1:]  # the first line read from the middle of the file is a fragment
    return lines, start + end


class LogScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "close", "Close", id="logview.close"),
        Binding("slash", "search", "Search", key_display="/", id="logview.search"),
        Binding("n", "next", "Next match", id="logview.next"),
        Binding("tab", "switch", "Next log", id="logview.switch"),
        Binding("G", "end", "Follow", id="logview.end"),
    ]

    def __init__(self, title: str, logs: list[tuple[str, str]]) -> None:
        super().__init__()
        self.title_text, self.logs = title, logs
        self.which = 0
        self.read_at: int | None = None
        self.lines: list[str] = []
        self.needle = ""
        self.match = -1

    def compose(self) -> ComposeResult:
        with Vertical(id="logview"):
            yield Static(id="logview-title")
            yield RichLog(id="logview-log", wrap=True, markup=True, auto_scroll=False, min_width=1,
                          max_lines=MAX_LINES)
            search = Input(placeholder="search (enter: next match, esc: close)", id="logview-search")
            search.display = False
            yield search

    def on_mount(self) -> None:
        self._open(0)
        self.set_interval(POLL_S, self._follow)

    def _open(self, which: int) -> None:
        self.which, self.read_at, self.lines, self.match = which, None, [], -1
        self.query_one(RichLog).clear()
        self._follow()
        self.query_one(RichLog).scroll_end(animate=False, immediate=False)
        self._title()

    def _title(self) -> None:
        label, path = self.logs[self.which] if self.logs else ("log", "")
        others = "  ".join(f"[b]{i}[/] {lbl}" for i, (lbl, _) in enumerate(self.logs) if i != self.which)
        found = f"  /{escape(self.needle)}: {sum(self.needle in x.lower() for x in self.lines)} lines" if self.needle else ""
        self.query_one("#logview-title", Static).update(
            f"[b]{escape(self.title_text)}[/]  {label} {escape(path)}{found}" + (f"  [dim]tab or: {others}[/]" if others else ""))

    def _follow(self) -> None:
        if not self.logs:
            return
        new, self.read_at = read_from(self.logs[self.which][1], self.read_at)
        if not new:
            return
        log = self.query_one(RichLog)
        at_end = log.is_vertical_scroll_end or not self.lines
        self.lines += new
        del self.lines[:-MAX_LINES]
        for line in new:
            log.write(self._markup(line), scroll_end=at_end)

    def _markup(self, line: str) -> str:
        text = escape(line)
        if self.needle and self.needle in line.lower():
            return f"[reverse]{text}[/]"
        return text

    def on_key(self, event) -> None:
        if event.character and event.character.isdigit() and int(event.character) < len(self.logs) \
                and not self.query_one(Input).display:
            self._open(int(event.character))
            event.stop()

    def action_switch(self) -> None:
        if self.logs:
            self._open((self.which + 1) % len(self.logs))

    def action_close(self) -> None:
        box = self.query_one(Input)
        if box.display:
            box.display = False
            self.query_one(RichLog).focus()
            return
        self.dismiss(None)

    def action_search(self) -> None:
        box = self.query_one(Input)
        box.display = True
        box.focus()

    def action_end(self) -> None:
        self.query_one(RichLog).scroll_end(animate=False)

    def on_input_changed(self, event: Input.Changed) -> None:
        self.needle = event.value.strip().lower()
        log = self.query_one(RichLog)
        log.clear()
        for line in self.lines:
            log.write(self._markup(line), scroll_end=False)
        self.match = -1
        self._title()

    def on_input_submitted(self, _event: Input.Submitted) -> None:
        self.action_next()

    def action_next(self) -> None:
        """Scroll to the next line that matches the search (wrapping around)."""
        if not self.needle:
            return
        hits = [i for i, line in enumerate(self.lines) if self.needle in line.lower()]
        if not hits:
            return
        self.match = next((i for i in hits if i > self.match), hits[0])
        log = self.query_one(RichLog)
        # lines wrap: place the view by the share of lines above the match
        log.scroll_to(y=int(log.virtual_size.height * self.match / max(1, len(self.lines))), animate=False)
