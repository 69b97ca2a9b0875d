"""`dsv4-console`: the Textual operations console (kernel cache, sidecars, services, host,
device, registration, log) with the long actions run as `dsv4 …` commands on a host.

Every host is a Host (`console.fleet.host`) and the one-host console is a fleet of one: the app
holds a `FleetSession` (this host alone, or `--hosts/--fleet`'s hosts over ssh), its panes show
one host's typed snapshot (`app.host`: this one, or the one opened from the fleet screen), read
off the UI thread. The controllers only start actions and render what they tell (`JobControl`:
a host's cache jobs; `ServiceControl`: the service this console holds and the services it acts
on; `FleetControl`: the fleet screen's actions and log); everything runs through the fleet's
runner, the same code `dsv4 fleet` runs. Every mutating action, on either screen, goes through
one guard (`action_mutate`), which `--readonly` closes; one filter (`/`) narrows whichever
screen is shown. No torch: the commands import it, the console never does.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from textual import work
from textual.app import App, ComposeResult
from textual.binding import BindingType
from textual.containers import Grid
from textual.css.query import NoMatches
from textual.widgets import Footer, Static

from console.data.collectors import default_model_dir
from console.data.launch_state import LaunchState
from console.data.snapshot import Snapshot
from console.fleet.host import Host, HostReading
from console.fleet.session import FleetSession
from console.tui.control.fleet import FleetControl
from console.tui.control.jobs import HOST_ACTIONS, JobControl
from console.tui.control.service import ServiceControl
from console.tui.control.watch import FileWatch
from console.tui.filter_box import FilterBox
from console.tui.keys import BINDINGS, FLEET_MUTATING, MUTATING
from console.tui.panes.device import DevicePane
from console.tui.panes.host import HostPane
from console.tui.panes.log import LogPane
from console.tui.panes.programs import ProgramsPane
from console.tui.panes.registration import RegistrationPane
from console.tui.panes.services import ServicesPane
from console.tui.panes.sidecars import SidecarsPane
from console.tui.reading import ReadingKeys
from console.tui.screens.fleet import FleetScreen
from console.tui.topbar import topbar_line
from console.tui.workers import WorkerEvent, WorkerLine
from runtime.launch.spec import LaunchSpec
from store.checkpoint import INDEX_NAME

MIN_SIZE = (80, 24)  # below this: one line saying so, not a broken layout
COMPACT_BELOW = (120, 36)  # below this: one column, panes collapse to summaries but the focused one


class Dsv4Console(ReadingKeys, App):
    CSS_PATH = "app.tcss"
    TITLE = "dsv4-console"
    AUTO_FOCUS = "#programs-table"
    BINDINGS: ClassVar[list[BindingType]] = BINDINGS

    def __init__(self, spec: LaunchSpec, *, session: FleetSession | None = None, host: Host | None = None,
                 readonly: bool = False, interval: float = 2.0, watch: bool = True, create_default: bool = True,
                 stop_timeout: float = 10.0):
        """`spec`: what the console was started with (its model and kernel cache dir resolved):
        every action it starts carries it (`w` compiles for it, `l` launches it, `p` packs for its
        ranks, `x` purges by its plan). `session`: the fleet (`--hosts/--fleet`); without one, a
        fleet of one: `host` (default: this host)."""
        super().__init__()
        from console.fleet.local import LocalHost

        self.base_spec = spec
        self.session = session or FleetSession([host or LocalHost()], spec)
        # the host the panes show: a fleet of one shows its host at once, a fleet its screen first
        self.host: Host | None = next(iter(self.session.hosts.values())) if self.session.alone else None
        self.readonly, self.interval = readonly, interval
        local = self.host is not None and self.host.kind == "local"
        self.create_default = create_default and local
        self.watch_files = watch and local
        self.snapshot: Snapshot | None = None
        self.reading: HostReading | None = None  # the shown host's latest reading (its age, why not fresh)
        self.jobs_control = JobControl(self)
        self.service_control = ServiceControl(self, stop_timeout)
        self.fleet = FleetControl(self, self.session)
        self.refused: list[str] = []
        self.needle = ""
        self.files = FileWatch(self)
        self.first_paint: float | None = None

    @property
    def spec(self) -> LaunchSpec:
        """The launch every action carries: the console's (a fleet's: over the hosts not left out)."""
        return self.session.spec if not self.session.alone else self.base_spec

    @property
    def remote(self) -> str | None:
        """The name of the host the panes show, when it is not this one."""
        return self.host.name if self.host is not None and self.host.kind != "local" else None

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
        if not self.session.alone:
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
        """Each second: a running job's progress, and every age an ending shows ("12 s ago" in
        the header, the Registration pane and the Services pane: one clock, rendered again as it
        moves)."""
        if self.jobs_control.running():
            self.jobs_control.tick_jobs()
        if self.jobs_control.running() or (self.launch is not None and self.launch.ending is not None):
            self.show_registration()
            self.topbar()
        services = self.pane(ServicesPane)
        if services is not None and self.snapshot is not None and any(v.ended for v in self.snapshot.services.services):
            services.show(self.snapshot.services, time.time(), self.needle)  # its endings' ages, by the same clock

    def _needs_default(self) -> bool:
        return self.spec.model == default_model_dir() and not (self.spec.model / INDEX_NAME).is_file()

    def topbar(self) -> None:
        bar = self.pane("#topbar", Static)
        if bar is not None:
            compact = self.screen_stack[0].has_class("-compact") if self.screen_stack else False
            bar.update(topbar_line(self, compact))

    # -- snapshots ----------------------------------------------------------------------------

    def refresh_now(self) -> None:
        if self.host is None:
            return  # no host chosen yet: the fleet screen collects every host itself
        if not self.host.blocking:  # a host of given snapshots: no thread, deterministic paints
            self.apply_reading(self._read(self.host))
            return
        self._collect(self.host)

    def _read(self, host: Host) -> HostReading:
        snap = self.session.collector.snapshot(only=[host.name])
        return snap.reading(host.name)

    @work(thread=True, exclusive=True, group="collect")
    def _collect(self, host: Host) -> None:
        try:
            reading = self._read(host)
        except Exception as e:  # a collector bug must not take the console down
            self.call_from_thread(self.log_line, "error", f"collect failed: {type(e).__name__}: {e}")
            return
        self.call_from_thread(self.apply_reading, reading)

    def apply_reading(self, reading: HostReading) -> None:
        """The shown host's reading: its snapshot on the panes (what was last known, while it is
        away), why it is not fresh in the top line."""
        if self.host is None or reading.host != self.host.name:
            return  # another host was opened meanwhile
        was, self.reading = self.reading, reading
        if reading.error and (was is None or was.error != reading.error):
            self.log_line("error", f"{reading.host}: {reading.error}")
        if reading.snapshot is not None:
            self.apply_snapshot(reading.snapshot)
        else:
            self.topbar()

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
        if changed("device") or changed("services"):  # its ranks' device use comes with the services
            show(DevicePane, snap.device, snap.services)
        if changed("registration"):
            self.show_registration()
        if old is None:
            self.service_control.attach()
        self.topbar()
        if self.watch_files:
            self.files.rearm()

    def show_registration(self) -> None:
        self.service_control.show_registration()

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
        """An event of the held service (its events file, tailed): the actions' come through the runner."""
        if message.worker is self.service:
            self.service_control.event(message.event)

    # -- the one guard of every mutating action -----------------------------------------------

    def action_mutate(self, name: str) -> None:
        """The one guard of every mutating action, on the panes and on the fleet screen alike:
        `--readonly` refuses them all here; the fleet screen's act on its selected hosts, the
        panes' on the host they show."""
        on_fleet = isinstance(self.screen, FleetScreen)
        if name not in (FLEET_MUTATING if on_fleet else MUTATING):
            raise ValueError(f"unknown action {name}")
        if self.readonly:
            self.refused.append(name)
            self.notify(f"read-only: {name} refused", severity="warning")
            self.log_line("console", f"read-only: {name} refused")
            return
        if on_fleet:
            self.fleet.act(name, self.screen.selection())
            return
        jobs, service = self.jobs_control, self.service_control
        if name in HOST_ACTIONS:
            jobs.purge() if name == "purge" else jobs.start(name)
        elif name == "launch" and (not self.session.alone or self.host.kind == "ssh"):
            # a fleet host's service is the fleet's (one remote host alone: `dsv4 service start` there)
            self.fleet.act("launch", self.session.active())
        else:
            {"create": jobs.create, "launch": service.launch_new, "stop": service.stop,
             "dismiss": service.dismiss}[name]()

    # -- the fleet ----------------------------------------------------------------------------------

    def show_host(self, name: str) -> None:
        """The one-host panes, with their actions, for fleet host `name` (the fleet screen's Enter)."""
        self.host, self.snapshot, self.reading = self.session.hosts[name], None, None
        self.jobs_control.jobs.clear()
        self.jobs_control.progress.clear()
        self.pop_screen()
        self.refresh_now()

    def action_fleet(self) -> None:
        if not self.session.alone and not isinstance(self.screen, FleetScreen):
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
