"""A service's log, as k9s's `l` shows a pod's: its last lines, then the tail as it grows
(followed only while the view is at the bottom), wrapped to the width, `/` to search (enter
jumps to the next match, `n` again), and the service's other logs — each rank's, on whichever
host it runs, read over that host's connection (`console.fleet.host.LogFeed`) — one key away
(`tab`, or its number); `p` the previous run's of the one shown (kept beside it when the same
port, rank or node ran before), `p` again back."""

from __future__ import annotations

from typing import ClassVar

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, RichLog, Static

from console.fleet.host import LogFeed

POLL_S = 0.5
MAX_LINES = 5000


class LogScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "close", "Close", id="logview.close"),
        Binding("slash", "search", "Search", key_display="/", id="logview.search"),
        Binding("n", "next", "Next match", id="logview.next"),
        Binding("tab", "switch", "Next log", id="logview.switch"),
        Binding("p", "previous", "Previous run", id="logview.previous"),
        Binding("G", "end", "Follow", id="logview.end"),
    ]

    def __init__(self, title: str, feeds: list[LogFeed]) -> None:
        super().__init__()
        self.title_text, self.feeds = title, feeds
        self.which = 0
        self.held: list[list[str]] = [[] for _ in feeds]  # every feed's lines so far (each is followed at once)
        self.lines: list[str] = []  # the shown feed's
        self.needle = ""
        self.match = -1
        self.previous_of: dict[int, int] = {}  # a feed → its previous run's (opened on `p`), and back

    def compose(self) -> ComposeResult:
        with Vertical(id="logview"):
            yield Static(id="logview-title")
            yield RichLog(id="logview-log", wrap=True, markup=True, auto_scroll=False, min_width=1,
                          max_lines=MAX_LINES)
            search = Input(placeholder="search (enter: next match, esc: close)", id="logview-search")
            search.display = False
            yield search

    def on_mount(self) -> None:
        for feed in self.feeds:
            feed.start()
        self._open(0)
        self.set_interval(POLL_S, self._follow)

    def on_unmount(self) -> None:
        for feed in self.feeds:
            feed.close()

    def _open(self, which: int) -> None:
        self.which, self.match = which, -1
        self._follow()  # what came meanwhile, into every feed's lines
        self.lines = self.held[which] if self.feeds else []
        log = self.query_one(RichLog)
        log.clear()
        for line in self.lines:
            log.write(self._markup(line), scroll_end=False)
        log.scroll_end(animate=False, immediate=False)
        self._title()

    def _title(self) -> None:
        feed = self.feeds[self.which] if self.feeds else None
        label = feed.label if feed else "log"
        where = f"{feed.host_name}:{feed.where}" if feed and feed.host_name else (feed.where if feed else "")
        others = "  ".join(f"[b]{i}[/] {f.label}" for i, f in enumerate(self.feeds) if i != self.which)
        found = (f"  /{escape(self.needle)}: {sum(self.needle in x.lower() for x in self.lines)} lines"
                 if self.needle else "")
        error = f"  [red]{escape(feed.error)}[/]" if feed and feed.error else ""
        self.query_one("#logview-title", Static).update(
            f"[b]{escape(self.title_text)}[/]  {label} {escape(where)}{found}{error}"
            + (f"  [dim]tab or: {others}[/]" if others else ""))

    def _follow(self) -> None:
        """Every feed's new lines (each is followed, shown or not); the shown one's on screen."""
        log = self.query_one(RichLog)
        for i, feed in enumerate(self.feeds):
            new = feed.poll()
            if not new:
                continue
            held = self.held[i]
            at_end = log.is_vertical_scroll_end or not held
            held += new
            del held[:-MAX_LINES]
            if i == self.which:
                for line in new:
                    log.write(self._markup(line), scroll_end=at_end)
                self._title()

    def _markup(self, line: str) -> str:
        text = escape(line)
        if self.needle and self.needle in line.lower():
            return f"[reverse]{text}[/]"
        return text

    def on_key(self, event) -> None:
        if event.character and event.character.isdigit() and int(event.character) < len(self.feeds) \
                and not self.query_one(Input).display:
            self._open(int(event.character))
            event.stop()

    def action_previous(self) -> None:
        """The previous run's log of the one shown (opened once, then one key away), or back."""
        from store.errors import UserError

        if not self.feeds:
            return
        if self.which in self.previous_of:
            self._open(self.previous_of[self.which])
            return
        feed = self.feeds[self.which]
        if feed.earlier is None:
            self.app.notify(f"{feed.label}: no previous run's log is kept for it", severity="warning")
            return
        try:
            earlier = feed.earlier()
        except UserError as e:
            self.app.notify(str(e), severity="warning")
            return
        earlier.start()
        self.feeds.append(earlier)
        self.held.append([])
        at = len(self.feeds) - 1
        self.previous_of[self.which], self.previous_of[at] = at, self.which
        self._open(at)

    def action_switch(self) -> None:
        if self.feeds:
            self._open((self.which + 1) % len(self.feeds))

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
