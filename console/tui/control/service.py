"""The service this console holds, and every service of the host it shows (this one, or a fleet
host opened from the fleet screen): launch, re-attach, stop, dismiss, open a log, quit. Launch,
stop and dismiss are the fleet's actions, run by its runner on that host (`console.fleet.actions`:
a launch on a fleet of one is `dsv4 service start`, a stop `dsv4 service stop PID`), so the same
keys act on this host and on one over ssh; the logs come through the host too (`Host.log`).

The service a launch starts is detached under its own supervisor (it outlives the console, and
"Leave running" leaves it running for real); the console attaches to it by its record, as a
console that starts while one of its services runs re-attaches to it. The service is one identity
(`store.services.ServiceId`) in every line this console writes. When it ends the console says
its cause, once — "killed by SIGKILL during serve", "exited 1: <its error line>", "rank 1 on
host-b …" — from the registry's ending (the service's own words, or its supervisor's for a
signal), with an age that moves, in the header, the Registration pane and the Services pane.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from rich.markup import escape
from textual.app import App

from console.data.launch_state import LaunchState
from console.data.services import ServiceView
from console.tui.detached import Detached
from console.tui.screens.confirm import ConfirmScreen
from console.tui.screens.logview import LogScreen
from console.tui.screens.quit import LEAVE, STOP, QuitScreen
from runtime.events import Event
from store import services

ENDING_WAIT_S = 3.0  # a service's supervisor records a signal a moment after the process is gone


class ServiceControl:
    def __init__(self, app: App, stop_timeout: float):
        self.app, self.stop_timeout = app, stop_timeout
        self.held: Detached | None = None  # the service this console launched or re-attached to
        self.launch: LaunchState | None = None  # its launch, as the Registration pane shows it
        self.status = ""
        self.asked_to_stop: set[str] = set()  # identities the operator stopped here: no row left behind
        self.starting = False  # `dsv4 service start` runs: the service has no record yet

    @property
    def running(self) -> bool:
        return self.held is not None and self.held.running

    def identity(self) -> services.ServiceId | None:
        """The held service's identity (its launcher's pid and start time)."""
        return self.held.identity if self.held is not None else None

    def name(self) -> str:
        """`pid 4242 http://127.0.0.1:8000` (or `(registering)`): how every line names it."""
        url = self.launch.url if self.launch and self.launch.url else "(registering)"
        return f"pid {self.held.pid} {url}" if self.held else ""

    def show_registration(self) -> None:
        """The Registration pane: the launch in view, or the next one's prediction (while the
        first run creates the checkpoint, what that waits for)."""
        from console.tui.panes.registration import RegistrationPane

        app = self.app
        pane = app.pane(RegistrationPane)
        if not app.snapshot or pane is None:
            return
        registration, status = app.snapshot.registration, self.status
        jobs = app.jobs_control
        creating = jobs.progress.get("create") if "create" in jobs.running() else None
        if creating is not None:  # the checkpoint a plan fails on is the one being made: say that, not FAIL
            registration = dataclasses.replace(registration, prediction={
                phase: "waits for the checkpoint being created" for phase in registration.prediction})
            status = f"{creating.line()} — then w warms it, l launches"
        pane.show(registration, self.launch, status)

    # -- launch -------------------------------------------------------------------------------

    def new_launch(self, spawned: float | None = None) -> LaunchState:
        """A launch in view, with the prediction made for it and the launch it compares with."""
        reg = self.app.snapshot.registration if self.app.snapshot else None
        compared = reg.previous if reg else None
        if spawned and compared and (compared.started or 0) >= spawned - 1:
            compared = reg.earlier  # re-attached: the last record is this launch's own (never compared with itself)
        programs = self.app.snapshot.programs.entries if self.app.snapshot else ()
        state = LaunchState(prediction=dict(reg.prediction) if reg else {}, basis=reg.basis if reg else "",
                            compared=compared, predicted=dict(reg.predicted) if reg else {},
                            order=[p.program for p in programs])
        if spawned:
            state.spawned = spawned
        return state


    def _same_model(self) -> list[ServiceView]:
        snap = self.app.snapshot.services.services if self.app.snapshot else ()
        return [s for s in snap if s.model == str(self.app.spec.model) and not s.ended]

    def launch_new(self) -> None:
        app = self.app
        if self.running or self.starting:
            app.notify(f"this console's service is {'starting' if self.starting else 'running'} ({self.name()}); "
                       "stop it first (s)", severity="warning")
            return
        if not app.jobs_control.model_ready():
            return
        serving = self._same_model()
        if not serving:
            self._launch()
            return
        names = "\n".join(f"  pid {s.pid} {s.url or s.state}" for s in serving)
        app.push_screen(ConfirmScreen("Launch a second copy?", f"{app.spec.model} is already being "
                                      f"served:\n{names}\nA second copy needs its own port and memory."),
                        lambda yes: self._launch() if yes else None)

    def _launch(self) -> None:
        app = self.app
        plan = app.snapshot.plan if app.snapshot else None
        if app.spec.ready == "auto" and plan is not None and plan.ready == "early":  # say so: it serves eager meanwhile
            compiling = sum(e.state.compiles for e in plan.programs)
            app.notify(f"--ready auto is early here: {compiling} programs to compile; it serves on the eager "
                       "tier meanwhile and swaps each in as it compiles", title="launch")
        self.launch = self.new_launch()
        self.status = "starting the service…"
        app.show_registration()
        app.run_worker(self._start(), group="jobs")

    async def _start(self) -> None:
        """The fleet's launch on this fleet of one (`dsv4 service start` through the host's funnel:
        `dsv4 serve` detached under its supervisor, with every setting the console was started
        with; `--ready auto` lets the launch's own plan decide), then this console attaches to
        the service it started by its record, as it re-attaches to one at start."""
        from console.fleet.runner import Runner

        app, host = self.app, self.app.host
        self.starting = True
        try:
            jobs = await app.session.runner.run("launch", [host.name])
        finally:
            self.starting = False
        job, launch = jobs[host.name], self.launch
        record = Runner.service_record(job)
        if not job.ok or record is None:
            why = job.outcome if not job.ok else "dsv4 service start printed no record"
            if launch is not None:
                launch.end(f"did not start: {why}", failed=True)
            self.status = ""
            app.notify(escape(f"launch: {why}"), title="launch failed", severity="error", timeout=10)
            app.show_registration()
            return
        service = services.Service.from_json(record)
        if launch is not None:
            launch.spawned = service.create_time  # the whole launch counts from its process's start
        self.status = ""
        self._hold(service, fresh=True)
        app.log_line("console", f"launch: pid {service.pid}, log {self.held.log_path or service.log}")

    def _hold(self, service: services.Service, fresh: bool) -> None:
        app = self.app
        self.held = Detached(service, fresh=fresh, **app.worker_callbacks())
        app.jobs["launch"] = self.held
        app.show_registration()
        app.topbar()
        app.run_worker(self._watch(self.held), group="jobs")

    def attach(self) -> None:
        """At start: re-attach to the newest running service a console launched for this model here."""
        app = self.app
        if self.held is not None or not app.snapshot or app.host is None or app.host.kind != "local":
            return
        mine = [s for s in self._same_model() if s.from_console]
        if not mine or not services.is_current(mine[-1].record):
            return
        found = mine[-1].record
        self.launch = self.new_launch(spawned=found.create_time)
        app.log_line("console", f"re-attached to pid {found.pid} {found.url or found.state}; log "
                                f"{found.log_file or found.log}")
        self._hold(found, fresh=False)

    async def _watch(self, held: Detached) -> None:
        await self.app.jobs_control.finish(held, "launch")
        if held is self.held:
            await self.ended(held)

    # -- how it ended -------------------------------------------------------------------------

    async def ended(self, held: Detached) -> None:
        """The held service is gone: its cause (the signal, the rank and host, the service's own
        error line: the registry's ending, never its log's last line), everywhere it is shown, with
        an age that moves."""
        app, launch = self.app, self.launch
        phase = launch.current_phase() if launch else ""
        record = await ending_of(held.pid)
        if record is not None and not record.ended:  # nobody saw its end: its supervisor is gone too
            record = services.gone(record, phase, "no exit status was recorded (its supervisor is gone too)",
                                   by="console")
        ending = record.ending if record is not None else None
        if held.identity.key in self.asked_to_stop and record is not None:
            services.dismiss(record)  # the operator stopped it here: nothing to dismiss later
        stopped = ending is None or ending.how.startswith("stopped")
        line = ending.cause() if ending is not None else "stopped"
        if launch is not None:
            launch.end(line, failed=not stopped, ending=ending)
        if not stopped and held.identity.key not in self.asked_to_stop:
            app.notify(escape(ending.line()), title="service ended", severity="error", timeout=10)
        self.status = "" if launch is not None else line
        app.show_registration()
        app.topbar()
        app.refresh_now()

    # -- stop, dismiss, logs ------------------------------------------------------------------

    def selected(self) -> ServiceView | None:
        from console.tui.panes.services import ServicesPane

        pane = self.app.pane(ServicesPane)
        table = self.app.pane("#services-table")
        if pane is None or self.app.focused is not table:
            self.app.notify("select a service in the Services pane first: tab to it, pick one", severity="warning")
            return None
        view = pane.selected()
        if view is None:
            self.app.notify("no service is running on this host")
        return view

    def stop(self) -> None:
        """Stop the service selected in the Services pane, and only while that pane has focus (a
        stray `s` elsewhere drains nothing); always after asking, No the default."""
        view = self.selected()
        if view is None:
            return
        if view.ended:
            self.app.notify(f"pid {view.pid} has ended already ({view.ending_line()}); d dismisses it")
            return
        mine = self.running and view.identity == self.identity()
        in_flight = view.in_flight
        body = (f"pid {view.pid} {view.url or view.state}\nmodel {view.model}\nstarted by {view.who(mine)}\n"
                f"requests in flight: {'unknown' if in_flight is None else in_flight} (they are drained first)\n"
                f"SIGTERM, then SIGKILL after {self.stop_timeout:.0f} s.")

        def confirmed(yes: bool | None) -> None:
            if not yes:
                self.app.log_line("console", f"stop: cancelled, pid {view.pid} left running")
                return
            self.asked_to_stop.add(view.identity.key)
            self.app.run_worker(self._act("stop", view.pid, mine), group="stop")

        self.app.push_screen(ConfirmScreen("Stop this service?", body), confirmed)

    async def _act(self, action: str, pid: int, mine: bool = False) -> bool:
        """`action` (stop, dismiss) on service `pid` of the shown host, through the fleet's runner
        (`dsv4 service stop|dismiss` there: this host, or one over ssh); True when it did."""
        app, host = self.app, self.app.host
        jobs = await app.session.runner.run(action, [host.name], service=pid, timeout=self.stop_timeout)
        job = jobs[host.name]
        if not job.ok:
            app.notify(escape(f"{action} pid {pid}: {job.outcome}"), severity="error", timeout=8)
        else:
            said = next((r.get("now") for r in reversed(job.records) if "now" in r), "")
            if mine:
                self.status = f"service stopped ({said or 'ended'})"
            app.notify(f"{action} pid {pid}: {said or 'done'}", title=host.name)
        app.refresh_now()
        return job.ok

    def dismiss(self) -> None:
        """`d`: forget the ended service selected in the Services pane."""
        view = self.selected()
        if view is None:
            return
        if not view.ended:
            self.app.notify(f"pid {view.pid} is {view.state}: only an ended service is dismissed (s stops it)",
                            severity="warning")
            return
        self.app.run_worker(self._act("dismiss", view.pid), group="stop")

    def open_log(self) -> None:
        """`L`: the selected service's log and each rank's, wherever they run, over each host's
        own connection (`console.fleet.logs`)."""
        from console.fleet.collector import FleetSnapshot
        from console.fleet.logs import feeds
        from store.errors import UserError

        view = self.selected()
        if view is None:
            return
        if not view.logs():
            self.app.notify(f"pid {view.pid} writes no log file this console can read (started from a terminal)",
                            severity="warning")
            return
        session = self.app.session
        try:
            found = feeds(session.hosts, FleetSnapshot(time.time(), session.collector.readings()), self.app.host.name,
                          view=view)
        except UserError as e:
            self.app.notify(str(e), severity="warning")
            return
        state = view.ending_line() if view.ended else view.state
        self.app.push_screen(LogScreen(f"pid {view.pid} {view.url or ''} {state}", found))

    # -- quit ---------------------------------------------------------------------------------

    def quit(self) -> None:
        app = self.app
        if not self.running:
            app.exit()
            return
        what = self.name()
        if self.held and self.held.log_path:
            what += f"\nlog {self.held.log_path}"

        def chosen(choice: str | None) -> None:
            if choice == LEAVE:
                app.exit()
            elif choice == STOP:
                app.run_worker(self._stop_then_exit(), group="stop")

        app.push_screen(QuitScreen(what), chosen)

    async def _stop_then_exit(self) -> None:
        if self.held:
            self.asked_to_stop.add(self.held.identity.key)
            await self._act("stop", self.held.pid, mine=True)
        self.app.exit()

    def exit_message(self) -> str:
        """What `dsv4-console` prints when it leaves a service running."""
        if not self.running:
            return ""
        log = f"; log {self.held.log_path}" if self.held and self.held.log_path else ""
        return f"dsv4-console: left the service running: {self.name()}{log}"

    # -- its events ---------------------------------------------------------------------------

    def event(self, event: Event) -> None:
        launch = self.launch
        if launch is None:
            return
        was_serving = bool(launch.url)
        known = launch.error
        launch.apply(event)
        if event.kind == "log" and event.message:
            self.app.log_line(event.phase, event.message)
        if event.kind == "error" and launch.error and launch.error != known:  # one line per failure
            self.app.log_line("error", launch.error)
        if launch.url and not was_serving:
            self.app.notify(f"serving {launch.url}", title="launch done")
            self.app.topbar()
        self.app.show_registration()


async def ending_of(pid: int, wait: float = ENDING_WAIT_S) -> services.Service | None:
    """Service `pid`'s record once it says how it ended: its own words, or its supervisor's (a
    moment after the process is gone; a registry sweep's "gone", which may come first, is what
    stands only when no witness speaks within `wait` s); None once the record went (a stop as
    asked)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    record = services.find(pid)
    while record is not None and (record.ending is None or record.ending.by == "registry") and loop.time() < deadline:
        await asyncio.sleep(0.1)
        record = services.find(pid)
    return record
