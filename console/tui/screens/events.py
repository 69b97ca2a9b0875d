"""`e`: what happened, on every host of the fleet (the one-host console: this host), as one
timeline — each host's timeline file read over its own connection (`console.fleet.events.gather`),
merged by time, repeats folded as k9s's events are (`host-b unreachable … (×5 since 13:40:02)`):
services registering, serving, failed (rank, host, reason), stopped, relaunched; hosts stale,
unreachable and back (how long); actions started and ended. Re-read every few seconds and on `r`,
filtered as it is typed; a host whose timeline cannot be read says why at the top."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, RichLog, Static

from console.fleet.events import gather
from store import timeline as T

REREAD_S = 5.0
STYLE = {T.FAILED: "red", T.UNREACHABLE: "red", T.STALE: "yellow", T.BACK: "green", T.SERVING: "green",
         T.LEFT_OUT: "yellow", T.RELAUNCHED: "yellow", T.STOPPED: "dim"}


def style_of(event: T.TimelineEvent) -> str:
    if event.kind == T.ENDED:
        return "green" if event.ok else "red"
    return STYLE.get(event.kind, "")


class EventsScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close", id="events.close"),
        Binding("r", "reread", "Read again", id="events.reread"),
        Binding("slash", "find", "Filter", key_display="/", id="events.filter"),
    ]

    def __init__(self, hosts: Mapping[str, Any], where: str = "") -> None:
        super().__init__()
        self.hosts, self.where = hosts, where
        self.counted: list[T.Counted] = []
        self.problems: dict[str, str] = {}
        self.needle = ""
        self.reads = 0

    def compose(self) -> ComposeResult:
        with Vertical(id="events"):
            yield Static(id="events-title")
            yield Input(placeholder="filter events (host, service, action, reason…)", id="events-filter")
            yield RichLog(id="events-log", wrap=True, markup=True, auto_scroll=False, min_width=1, max_lines=5000)
            yield Static("[dim]/: filter · r: read again · esc: close · "
                         "repeats folded: the latest, ×count since the first[/]")

    def on_mount(self) -> None:
        self.query_one("#events-log").focus()
        self.action_reread()
        self.set_interval(REREAD_S, self.action_reread)

    def action_reread(self) -> None:
        self.run_worker(self._read(), group="events", exclusive=True)

    async def _read(self) -> None:
        events, self.problems = await gather(self.hosts)
        self.counted = T.counted(events)
        self.reads += 1
        self._show()

    def _matches(self, c: T.Counted) -> bool:
        return not self.needle or self.needle in c.line().lower()

    def _show(self) -> None:
        log = self.query_one("#events-log", RichLog)
        at_end = log.is_vertical_scroll_end or self.reads <= 1
        log.clear()
        for host, why in self.problems.items():
            log.write(f"[red]{escape(host)}: its timeline could not be read: {escape(why)}[/]", scroll_end=False)
        shown = [c for c in self.counted if self._matches(c)]
        for c in shown:
            text, style = escape(c.line()), style_of(c.event)
            log.write(f"[{style}]{text}[/]" if style else text, scroll_end=False)
        if not self.counted:
            log.write("[dim]nothing happened yet: no host's timeline has an event[/]", scroll_end=False)
        if at_end:
            log.scroll_end(animate=False, immediate=False)
        hosts = len(self.hosts)
        head = f"What happened on {self.where or 'the fleet'}" + (f" ({hosts} hosts)" if hosts > 1 else "")
        count = f"{len(shown)} of {len(self.counted)}" if self.needle else f"{len(self.counted)}"
        self.query_one("#events-title", Static).update(f"[b]{escape(head)}[/]  {count} events, oldest first")

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.needle = event.value.strip().lower()
        self._show()

    def action_find(self) -> None:
        self.query_one(Input).focus()

    def action_close(self) -> None:
        box = self.query_one(Input)
        if box.has_focus:  # esc in the filter: back to the events, the filter kept
            self.query_one("#events-log").focus()
            return
        self.dismiss(None)

    def lines(self) -> list[str]:
        """What it shows, as plain lines (for tests and tmux alike)."""
        return [c.line() for c in self.counted if self._matches(c)]
