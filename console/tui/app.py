"""`dsv4-console`: the Textual operations console (kernel cache, sidecars, services, host,
device, registration, log) with the long actions run as `dsv4 …` worker processes.

Collectors (`console.data`, a torch-free library) return typed snapshots off the UI thread; panes
render them. The state of what the console runs lives in two small controllers (`JobControl`: the
cache jobs; `ServiceControl`: the service it holds and the services it acts on); worker output
reaches the screen as Textual messages. Every mutating action goes through one guard
(`action_mutate`), which `--readonly` closes. The filter box (`filter_box`) and the top line
(`topbar`) are their own modules; the fleet screen's plumbing is `FleetControl`'s. No torch: the
workers import it, the console never does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any, ClassVar

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding, BindingType
from textual.containers import Grid
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from console.data.collectors import Collectors, default_model_dir
from console.data.launch_state import LaunchState
from console.data.snapshot import Snapshot
from console.tui.control.jobs import JobControl
from console.tui.control.service import ServiceControl
from console.tui.control.watch import FileWatch
from console.tui.filter_box import FilterBox
from console.tui.panes.device import DevicePane
from console.tui.panes.host import HostPane
from console.tui.panes.log import LogPane
from console.tui.panes.programs import ProgramsPane
from console.tui.panes.registration import RegistrationPane
from console.tui.panes.services import ServicesPane
from console.tui.panes.sidecars import SidecarsPane
from console.tui.screens.detail import DetailScreen
from console.tui.screens.help import HelpScreen
from console.tui.screens.history import HistoryScreen
from console.tui.tables import PaneTable
from console.tui.topbar import topbar_line
from console.tui.workers import WorkerEvent, WorkerLine
from runtime.launch.spec import LaunchSpec
from store.checkpoint import INDEX_NAME

MUTATING = frozenset({"prepack", "purge", "warm", "launch", "stop", "create", "dismiss"})
MIN_SIZE = (80, 24)  # below this: one line saying so, not a broken layout
COMPACT_BELOW = (120, 36)  # below this: one column, panes collapse to summaries but the focused one


class Dsv4Console(App):
    CSS_PATH = "app.tcss"
    TITLE = "dsv4-console"
    AUTO_FOCUS = "#programs-table"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit_console", "Quit", id="quit", tooltip="quit (asks about a service this console runs)"),
        Binding("question_mark", "help", "Help", key_display="?", id="help", tooltip="this screen"),
        Binding("r", "refresh", "Refresh", id="refresh", show=False, tooltip="collect every pane now"),
        Binding("slash", "filter", "Filter", key_display="/", id="filter", show=False,
                tooltip="filter every pane's rows and the log (enter keeps it, esc clears it)"),
        Binding("z", "zoom", "Zoom", id="zoom", tooltip="maximise the focused pane (again: restore)"),
        Binding("h", "history", "History", id="history", show=False, tooltip="past launches, newest first"),
        Binding("c", "kernel_cache", "Kernel cache", id="kernel-cache", show=False,
                tooltip="Programs pane: next launch's programs ↔ the kernel cache's entries"),
        Binding("ctrl+s", "save_log", "Save log", id="save-log", show=False,
                tooltip="write the log to a file under the state dir"),
        Binding("p", "mutate('prepack')", "Prepack", id="prepack",
                tooltip="pack the checkpoint into a sidecar (progress in Sidecars)"),
        Binding("w", "mutate('warm')", "Warm", id="warm",
                tooltip="read the sidecar into the page cache, then compile"),
        Binding("x", "mutate('purge')", "Purge", id="purge",
                tooltip="delete what the plan calls stale or corrupt; in the kernel cache view, every entry "
                "that can never be used again (asks; lists why)"),
        Binding("l", "mutate('launch')", "Launch", id="launch",
                tooltip="dsv4 serve on --host/--port, detached (see Registration)"),
        Binding("s", "mutate('stop')", "Stop", id="stop",
                tooltip="stop the service selected in Services (that pane focused; asks first)"),
        Binding("d", "mutate('dismiss')", "Dismiss", id="dismiss", show=False,
                tooltip="forget the ended service selected in Services (it stays a row until then)"),
        Binding("L", "service_log", "Service log", id="service-log", show=False,
                tooltip="the log of the service selected in Services (tab: each rank's; / searches)"),
        Binding("F", "fleet", "Fleet", id="fleet", show=False,
                tooltip="--hosts/--fleet: back to every host of the service"),
    ]

    def __init__(self, spec: LaunchSpec, *, collectors: Any | None = None, readonly: bool = False,
                 interval: float = 2.0, watch: bool = True, create_default: bool = True,
                 stop_timeout: float = 10.0, fleet: Any | None = None):
        """`spec`: what the console was started with (its model and kernel cache dir resolved):
        every action it starts carries it (`w` compiles for it, `l` launches it, `p` packs for its
        ranks, `x` purges by its plan)."""
        super().__init__()
        self.spec = spec
        self.collectors = collectors or (fleet.collector if fleet is not None else Collectors(spec))
        self.readonly, self.interval, self.watch_files = readonly, interval, watch
        self.create_default = create_default
        self.snapshot: Snapshot | None = None
        self.jobs_control = JobControl(self)
        self.service_control = ServiceControl(self, stop_timeout)
        self.refused: list[str] = []
        self.needle = ""
        self.files = FileWatch(self)
        self.first_paint: float | None = None
        # --hosts/--fleet (console.fleet.collector.FleetSetup): the fleet screen first; the one-host
        # panes show the host chosen there, from its snapshots (its actions run from the fleet screen)
        self.fleet = None
        if fleet is not None:
            from console.tui.control.fleet import FleetControl

            self.fleet = FleetControl(self, fleet)
            self.create_default = self.watch_files = False
        self.remote: str | None = None  # the fleet host the panes show (None: this host)

    # what the controllers hold, by the names the panes and tests read
    jobs = property(lambda self: self.jobs_control.jobs)
    progress = property(lambda self: self.jobs_control.progress)
    failures = property(lambda self: self.jobs_control.failures)

    @property
    def service(self):
        return self.service_control.held

    @service.setter
    def service(self, held) -> None:
        self.service_control.held = held

    @property
    def launch(self) -> LaunchState | None:
        return self.service_control.launch

    @launch.setter
    def launch(self, launch: LaunchState | None) -> None:
        self.service_control.launch = launch

    @property
    def status(self) -> str:
        return self.service_control.status

    # -- layout -------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(id="topbar")
        yield Static(f"terminal too small (need {MIN_SIZE[0]}×{MIN_SIZE[1]})", id="too-small")
        with Grid(id="panes"):
            yield ProgramsPane(id="programs")
            yield ServicesPane(id="services")
            yield SidecarsPane(id="sidecars")
            yield HostPane(id="host")
            yield RegistrationPane(id="registration")
            yield DevicePane(id="device")
            yield LogPane(id="logpane")
        yield FilterBox()
        yield Footer()

    def on_mount(self) -> None:
        self._fit(self.size.width, self.size.height)
        if self.fleet is not None:
            from console.tui.screens.fleet import FleetScreen

            self.install_screen(FleetScreen(self.fleet, self.interval), name="fleet")
            self.push_screen("fleet")
        # collect after the first paint: the empty screen shows at once, data follows
        self.call_after_refresh(self.refresh_now)
        if self.interval > 0:
            self.set_interval(self.interval, self.refresh_now)
            self.set_interval(1.0, self._tick)
        self.call_after_refresh(self._painted)
        if self.create_default and self._needs_default():
            self.action_mutate("create")

    def on_resize(self, event) -> None:
        self._fit(event.size.width, event.size.height)

    def _fit(self, width: int, height: int) -> None:
        screen = self.screen_stack[0] if self.screen_stack else self.screen
        screen.set_class(width < MIN_SIZE[0] or height < MIN_SIZE[1], "-tiny")
        compact = width < COMPACT_BELOW[0] or height < COMPACT_BELOW[1]
        screen.set_class(compact, "-compact")
        # at 80 columns the palette hint would push `s Stop` off the footer (ctrl+p still works)
        footer = self.pane(Footer)
        if footer is not None and footer.show_command_palette == compact:
            footer.show_command_palette = not compact
            footer.refresh(recompose=True)  # the footer reads it only when it composes
        self.topbar()

    def _painted(self) -> None:
        self.first_paint = time.monotonic()

    def _tick(self) -> None:
        if self.jobs_control.running():
            self.jobs_control.tick_jobs()
            self.show_registration()

    def _needs_default(self) -> bool:
        return self.spec.model == default_model_dir() and not (self.spec.model / INDEX_NAME).is_file()

    def topbar(self) -> None:
        bar = self.pane("#topbar", Static)
        if bar is not None:
            compact = self.screen_stack[0].has_class("-compact") if self.screen_stack else False
            bar.update(topbar_line(self, compact))

    # -- snapshots ----------------------------------------------------------------------------

    def refresh_now(self) -> None:
        if self.fleet is not None and self.remote is None:
            return  # no host chosen yet: the fleet screen collects every host itself
        if getattr(self.collectors, "inline", False):  # fake collectors: no thread, deterministic paints
            self.apply_snapshot(self.collectors.snapshot())
            return
        self._collect()

    @work(thread=True, exclusive=True, group="collect")
    def _collect(self) -> None:
        try:
            snap = self.collectors.snapshot()
        except Exception as e:  # a collector bug must not take the console down
            self.call_from_thread(self.log_line, "error", f"collect failed: {type(e).__name__}: {e}")
            return
        self.call_from_thread(self.apply_snapshot, snap)

    def pane(self, selector, expect_type=None) -> Any:
        """A widget of the main screen (a class or a selector), or None while it is not there
        (first run, shutdown): a late snapshot or worker line must never crash the console."""
        try:
            screen = self.screen_stack[0]
            if isinstance(selector, type) and expect_type is None:
                return screen.query_one(selector)
            return screen.query_one(selector) if expect_type is None else screen.query_one(selector, expect_type)
        except (NoMatches, IndexError):
            return None

    def apply_snapshot(self, snap: Snapshot, force: bool = False) -> None:
        try:
            self._apply_snapshot(snap, force)
        except NoMatches:
            # a late snapshot met a pane whose children are being removed (the console is
            # shutting down): there is nothing left to show it on
            if self.is_running:
                raise

    def _apply_snapshot(self, snap: Snapshot, force: bool) -> None:
        old, self.snapshot = self.snapshot, snap
        # repaint a pane only when its data changed: idle refreshes stay cheap

        def changed(part: str) -> bool:
            return force or old is None or getattr(old, part) != getattr(snap, part)

        def show(cls, *args) -> None:
            pane = self.pane(cls)
            if pane is not None:
                pane.show(*args)

        if changed("programs") or changed("cache"):
            show(ProgramsPane, snap.programs, snap.cache, snap.ts, self.needle)
        if changed("sidecars"):
            show(SidecarsPane, snap.sidecars, snap.ts, self.needle)
        show(ServicesPane, snap.services, snap.ts, self.needle)
        show(HostPane, snap.host)
        if changed("device"):
            show(DevicePane, snap.device)
        if changed("registration"):
            self.show_registration()
        if old is None and self.remote is None:
            self.service_control.attach()
        self.topbar()
        if self.watch_files and self.remote is None:
            self.files.rearm()

    def show_registration(self) -> None:
        pane = self.pane(RegistrationPane)
        if not self.snapshot or pane is None:
            return
        registration, status = self.snapshot.registration, self.status
        creating = self.jobs_control.progress.get("create") if "create" in self.jobs_control.running() else None
        if creating is not None:  # the checkpoint a plan fails on is the one being made: say that, not FAIL
            registration = dataclasses.replace(registration, prediction={
                phase: "waits for the checkpoint being created" for phase in registration.prediction})
            status = f"{creating.line()} — then w warms it, l launches"
        pane.show(registration, self.launch, status)

    # -- worker output ------------------------------------------------------------------------

    def log_line(self, source: str, text: str) -> None:
        pane = self.pane(LogPane)
        if pane is not None:
            pane.add(source, text)

    def worker_callbacks(self) -> dict[str, Any]:
        """A worker's callbacks: each event and line posted as a message to this app."""
        return {"on_event": lambda worker, event: self.post_message(WorkerEvent(worker, event)),
                "on_line": lambda worker, which, line: self.post_message(WorkerLine(worker, which, line))}

    def on_worker_line(self, message: WorkerLine) -> None:
        if message.line.strip():
            self.log_line(message.worker.name, message.line)

    def on_worker_event(self, message: WorkerEvent) -> None:
        worker, event = message.worker, message.event
        if event.kind == "error" and event.phase == worker.name:  # the parent's verdict on a dead worker
            self.jobs_control.failed(worker, event)
            if worker is self.service and self.launch:
                self.launch.apply(event)
            self.show_registration()
        elif worker is self.service:
            self.service_control.event(event)
        else:
            self.jobs_control.event(worker, event)

    # -- read-only actions --------------------------------------------------------------------

    def action_refresh(self) -> None:
        self.refresh_now()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.all_bindings(), MUTATING, self.readonly))

    def all_bindings(self) -> list[Binding]:
        return [b for b in [*self.BINDINGS, *PaneTable.BINDINGS]
                if isinstance(b, Binding) and (b.id != "fleet" or self.fleet is not None)]

    def action_history(self) -> None:
        history = self.collectors.history() if hasattr(self.collectors, "history") else []
        self.push_screen(HistoryScreen(history))

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
        self.query_one(FilterBox).open()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id != "filter":
            return
        self.needle = event.value.strip().lower()
        pane = self.pane(LogPane)
        if pane is not None:
            pane.filter(self.needle)
        if self.snapshot:
            self.apply_snapshot(self.snapshot, force=True)

    def on_key(self, event) -> None:
        box = self.query_one(FilterBox)
        if event.key == "escape" and box.display:  # esc: the filter goes with the box, wherever focus is
            box.clear_and_close()
            event.stop()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """The palette (ctrl+p) lists every action of the console; read-only hides the mutating."""
        for b in self.all_bindings():
            name = b.id or b.action
            if self.readonly and name in MUTATING:
                continue
            yield SystemCommand(f"{b.description or name} ({b.key_display or b.key})", b.tooltip or b.description,
                                lambda b=b: self._palette(b))
        yield SystemCommand("Theme", "change the colour theme", self.action_change_theme)

    def _palette(self, binding: Binding) -> None:
        if binding in PaneTable.BINDINGS:  # a table's own action: on the focused table
            table = self.focused if isinstance(self.focused, PaneTable) else self.pane("#programs-table")
            if table is not None:
                table.run_action(binding.action)
        else:
            self.run_action(binding.action)

    # -- the one guard of every mutating action -----------------------------------------------

    def action_mutate(self, name: str) -> None:
        if name not in MUTATING:
            raise ValueError(f"unknown action {name}")
        if self.fleet is not None:
            self.notify(f"{name}: the panes of {self.remote or 'a fleet host'} only show; act on hosts from the "
                        f"fleet screen (F)", severity="warning")
            return
        if self.readonly:
            self.refused.append(name)
            self.notify(f"read-only: {name} refused", severity="warning")
            self.log_line("console", f"read-only: {name} refused")
            return
        jobs, service = self.jobs_control, self.service_control
        {"create": jobs.create, "prepack": jobs.prepack, "warm": jobs.warm, "purge": jobs.purge,
         "launch": service.launch_new, "stop": service.stop, "dismiss": service.dismiss}[name]()

    # -- the fleet ----------------------------------------------------------------------------------

    def show_host(self, name: str) -> None:
        """The one-host panes, fed by `name`'s snapshots (the fleet screen's Enter)."""
        from console.fleet.collector import HostCollectors

        self.remote, self.snapshot = name, None
        self.collectors = HostCollectors(self.fleet.collector, name)
        self.pop_screen()
        self.refresh_now()

    def action_fleet(self) -> None:
        if self.fleet is not None and not isinstance(self.screen, type(self.get_screen("fleet"))):
            self.push_screen("fleet")

    # -- quit -----------------------------------------------------------------------------------

    async def action_quit(self) -> None:
        """Textual's own quit (ctrl+q, the palette): the same dialog as `q`."""
        self.action_quit_console()

    def action_quit_console(self) -> None:
        self.service_control.quit()

    def exit_message(self) -> str:
        return self.service_control.exit_message()


def main(argv: list[str] | None = None) -> int:
    from console.tui.args import run

    return run(argv, Dsv4Console)


if __name__ == "__main__":
    import sys

    sys.exit(main())
