"""The service this console holds, and every service of the host it shows (this one, or a fleet
host opened from the fleet screen): launch, re-attach, stop, dismiss, open a log, quit. Stop,
dismiss and the logs go through that host (`Host.command`, `Host.log`): the same keys act on
this host and on one over ssh.

A launch on this host runs detached (own session, output in files under the state dir) so
"Leave running" leaves it running for real; a console that starts while one of its services runs
re-attaches to it. The service is one identity (`store.services.ServiceId`) in every line this console
writes. When it ends the console says how, once — "killed by SIGKILL during serve", "exited 1:
<its error>" — in the Registration pane, the registry (whose row stays until dismissed) and the
launch history (when the service itself could not: a signal).
"""

from __future__ import annotations

import dataclasses
import os
import time

from rich.markup import escape
from textual.app import App

from console.data.launch_state import LaunchState
from console.data.services import ServiceView
from console.fleet import actions as A
from console.tui.detached import Detached
from console.tui.screens.confirm import ConfirmScreen
from console.tui.screens.logview import LogScreen
from console.tui.screens.quit import LEAVE, STOP, QuitScreen
from console.tui.workers import service_argv, shown
from runtime.events import Event
from runtime.launch.spec import SERVE
from store import history, services


class ServiceControl:
    def __init__(self, app: App, stop_timeout: float):
        self.app, self.stop_timeout = app, stop_timeout
        self.held: Detached | None = None  # the service this console launched or re-attached to
        self.launch: LaunchState | None = None  # its launch, as the Registration pane shows it
        self.status = ""
        self.asked_to_stop: set[str] = set()  # identities the operator stopped here: no row left behind

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
        if self.running:
            app.notify(f"this console's service is running ({self.name()}); stop it first (s)", severity="warning")
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
        log, events = services.output_paths(time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
        # every setting the console was started with; --ready auto (its default) lets the launch's
        # own plan decide: the eager tier at once when programs would compile and one rank serves
        argv = service_argv(*app.spec.with_(events=str(events)).argv(SERVE))
        plan = app.snapshot.plan if app.snapshot else None
        if app.spec.ready == "auto" and plan is not None and plan.ready == "early":  # say so: it serves eager meanwhile
            compiling = sum(e.state.compiles for e in plan.programs)
            app.notify(f"--ready auto is early here: {compiling} programs to compile; it serves on the eager "
                       "tier meanwhile and swaps each in as it compiles", title="launch")
        self.launch = self.new_launch()
        self.status = ""
        self.held = Detached("launch", argv, log=log, events=events, **app.worker_callbacks())
        app.jobs["launch"] = self.held
        app.log_line("console", f"launch: {shown(argv)}")
        app.log_line("console", f"launch: output in {log}")
        app.show_registration()
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
        self.held = Detached.attach(found, **app.worker_callbacks())
        app.jobs["launch"] = self.held
        app.log_line("console", f"re-attached to pid {found.pid} {found.url or found.state}; log {found.log}")
        app.run_worker(self._watch(self.held), group="jobs")

    async def _watch(self, held: Detached) -> None:
        code = await self.app.jobs_control.finish(held, "launch")
        if held is self.held:
            self.ended(held, code)

    # -- how it ended -------------------------------------------------------------------------

    def ended(self, held: Detached, code: int | None) -> None:
        """The held service is gone: one line of how, everywhere it is shown."""
        app, launch = self.app, self.launch
        record = services.find(held.pid) if held.pid else None
        identity = self.identity()
        phase = launch.current_phase() if launch else ""
        if code is not None and code < 0:  # a signal: the service could not say so itself
            how = services.how(code)
            error = (launch.error if launch else "") or (held.stderr_tail[-1] if held.stderr_tail else "")
            if record is not None:
                record = services.end(record, how, phase, error, by="console")
            if identity is not None:
                history.append({"v": 1, "launch": identity.key, "outcome": "killed", "error": error or how,
                                "end": how, "ended": round(time.time(), 3), "failed_phase": phase})
        elif code is None and record is not None and not record.ended:  # not our child: nobody saw its end
            record = services.gone(record, phase, "no exit status (not this console's child)", by="console")
        if identity is not None and identity.key in self.asked_to_stop and record is not None:
            services.dismiss(record)  # the operator stopped it here: nothing to dismiss later
            record = None
        ending = record.ending if record is not None else None
        if ending is not None:
            line = ending.line()
        else:  # it ended before it could announce itself (a port in use, a bad flag): its own last line
            last = held.stderr_tail[-1] if held.stderr_tail else ""
            line = (services.how(code) if code is not None else "ended") + (f": {last}" if code and last else "")
        if launch is not None:
            launch.end(line, failed=code not in (0, None) or (ending is not None and ending.how == services.GONE))
        if code not in (0, None) and not held.stopping:
            app.notify(line, title="service ended", severity="error", timeout=10)
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
            if mine:
                self.app.log_line("console", f"stop: SIGTERM to pid {view.pid}")
                self.app.run_worker(self._stop_held(), group="stop")
            else:
                self.app.run_worker(self._on_host(f"stop pid {view.pid}", A.service_stop(view.pid, self.stop_timeout)),
                                    group="stop")

        self.app.push_screen(ConfirmScreen("Stop this service?", body), confirmed)

    async def _stop_held(self) -> None:
        if self.held:
            code = await self.held.stop(self.stop_timeout)
            self.status = f"service stopped ({services.how(code) if code is not None else 'ended'})"
            self.app.log_line("console", self.status)
            self.app.notify(self.status, title="stopped")

    async def _on_host(self, what: str, args: tuple[str, ...]) -> bool:
        """`dsv4 ARGS` on the shown host (this one, or one over ssh): its lines in the log, its
        failure in one line; True when it did what it was asked."""
        app, host = self.app, self.app.host
        command = host.command(what, args, on_line=lambda c, which, line: app.log_line(host.name, line))
        app.log_line("console", f"{what} on {host.where}")
        code = await command.run()
        if code != 0:
            app.notify(escape(f"{what}: {host.why(code, list(command.stderr_tail))}"), severity="error", timeout=8)
        else:
            app.notify(f"{what}: done", title=host.name)
        app.refresh_now()
        return code == 0

    def dismiss(self) -> None:
        """`d`: forget the ended service selected in the Services pane."""
        view = self.selected()
        if view is None:
            return
        if not view.ended:
            self.app.notify(f"pid {view.pid} is {view.state}: only an ended service is dismissed (s stops it)",
                            severity="warning")
            return
        self.app.run_worker(self._on_host(f"dismiss pid {view.pid}", A.service_dismiss(view.pid)), group="stop")

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
            identity = self.identity()
            if identity is not None:
                self.asked_to_stop.add(identity.key)
            await self.held.stop(self.stop_timeout)
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
