"""The one-host screen's keys that change nothing: refresh, help, the launch history, the kernel
cache view, a service's log, what happened (`e`), zoom, save the log, details, the one filter,
the palette — a part of `console.tui.app.Dsv4Console`, kept apart so the app stays one screen's
wiring."""

from __future__ import annotations

from collections.abc import Iterable

from textual import work
from textual.app import SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Input

from console.tui.filter_box import FilterBox
from console.tui.keys import MUTATING, system_commands
from console.tui.panes.log import LogPane
from console.tui.panes.programs import ProgramsPane
from console.tui.screens.detail import DetailScreen
from console.tui.screens.events import EventsScreen
from console.tui.screens.fleet import FleetScreen
from console.tui.screens.help import HelpScreen
from console.tui.screens.history import HistoryScreen
from console.tui.tables import PaneTable


class ReadingKeys:
    """Mixed into the app (it has `session`, `host`, `pane`, `snapshot`, `needle`, …)."""

    def action_refresh(self) -> None:
        self.refresh_now()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.all_bindings(), MUTATING, self.readonly))

    def all_bindings(self) -> list[Binding]:
        return [b for b in [*self.BINDINGS, *PaneTable.BINDINGS]
                if isinstance(b, Binding) and (b.id != "fleet" or not self.session.alone)]

    def action_history(self) -> None:
        """`h`: the shown host's launch history (asked of it: another host's travels in its snapshot)."""
        if self.host is None:
            return
        if not self.host.blocking:
            self.push_screen(HistoryScreen(self.session.collector.history(only=[self.host.name])))
            return
        self._history(self.host.name)

    @work(thread=True, exclusive=True, group="history")
    def _history(self, name: str) -> None:
        records = self.session.collector.history(only=[name])
        self.call_from_thread(self.push_screen, HistoryScreen(records))

    def action_kernel_cache(self) -> None:
        pane = self.pane(ProgramsPane)
        table = pane.toggle() if pane is not None else None
        if table is not None:
            table.focus()

    def action_service_log(self) -> None:
        self.service_control.open_log()

    def action_zoom(self) -> None:
        screen = self.screen
        if screen.maximized is not None:
            screen.minimize()
            return
        focused = self.focused
        pane = next((a for a in (focused.ancestors if focused else []) if a.has_class("pane")), None)
        if pane is not None:
            screen.maximize(pane, container=False)

    def action_save_log(self) -> None:
        pane = self.pane(LogPane)
        path = pane.save() if pane is not None else None
        if path:
            self.notify(f"log saved to {path}", title="saved")

    def on_pane_table_chosen(self, message: PaneTable.Chosen) -> None:
        self.push_screen(DetailScreen(message.pane, message.row))

    def action_filter(self) -> None:
        """`/` on either screen: the one filter box, the shown screen's rows narrowed as it is typed."""
        self.screen.query_one(FilterBox).open()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id != "filter":
            return
        self.needle = event.value.strip().lower()
        if isinstance(self.screen, FleetScreen):
            self.screen.filter(self.needle)  # the fleet screen's hosts
            return
        pane = self.pane(LogPane)
        if pane is not None:
            pane.filter(self.needle)
        if self.snapshot:
            self.apply_snapshot(self.snapshot, force=True)

    def on_key(self, event) -> None:
        boxes = self.screen.query(FilterBox)
        if event.key == "escape" and boxes and boxes.first().display:  # esc: the filter goes with the box
            boxes.first().clear_and_close()
            event.stop()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The palette (ctrl+p) lists every action of the console; read-only hides the mutating."""
        yield from system_commands(self)

    def action_events(self) -> None:
        """`e`: what happened on every host of the fleet (a fleet of one: this host), one timeline."""
        alone = self.session.alone and self.host is not None
        self.push_screen(EventsScreen(self.session.hosts, self.host.where if alone else "the fleet"))
