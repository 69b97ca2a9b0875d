"""Launch, stop, re-attach and quit: every `dsv4 serve` on the host, whoever started it.

A launch runs detached (own session, output in files under the state dir) so "Leave running"
leaves it running for real; a console that starts while one of its services runs re-attaches
to it. Every way out (q, ctrl+q, the palette's Quit) goes through one quit dialog.
A mixin of `console.tui.app.Dsv4Console`."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from textual import work

from console.tui.data.launch_state import LaunchState
from console.tui.detached import Detached
from console.tui.screens.confirm import ConfirmScreen
from console.tui.screens.quit import LEAVE, STOP, QuitScreen
from console.tui.workers import dsv4, shown
from runtime.events import Event
from runtime.launch.spec import SERVE
from store import services

STOP_POLL = 0.1


class ServiceActions:
    service: Detached | None
    launch: LaunchState | None

    # -- launch -------------------------------------------------------------------------------

    def _same_model_services(self) -> list[dict[str, Any]]:
        snap = self.snapshot.services.services if self.snapshot else ()
        return [s for s in snap if s["model"] == str(self.spec.model)]

    def _do_launch(self) -> None:
        if self.service and self.service.running:
            self.notify(f"this console's service is running (pid {self.service.pid}); stop it first (s)",
                        severity="warning")
            return
        if not self._model_ready():
            return
        serving = self._same_model_services()
        if not serving:
            self._launch()
            return
        names = "\n".join(f"  pid {s['pid']} {s['url'] or s['state']}" for s in serving)
        self.push_screen(ConfirmScreen("Launch a second copy?", f"{self.spec.model} is already being "
                                       f"served:\n{names}\nA second copy needs its own port and memory."),
                         lambda yes: self._launch() if yes else None)

    def _launch(self) -> None:
        log, events = services.output_paths(time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
        # every setting the console was started with; --ready auto (its default) lets the launch's
        # own plan decide: the eager tier at once when programs would compile and one rank serves
        argv = dsv4("serve", *self.spec.with_(events=str(events)).argv(SERVE))
        plan = (self.snapshot.plan if self.snapshot else None) or {}
        if self.spec.ready == "auto" and plan.get("ready") == "early":  # say so: it serves eager meanwhile
            compiling = sum(e.get("state") not in ("HIT", "EAGER") for e in plan.get("programs", ()))
            self.notify(f"--ready auto is early here: {compiling} programs to compile; it serves on the eager "
                        "tier meanwhile and swaps each in as it compiles", title="launch")
        self.launch = self.new_launch()
        self.status = ""
        self.service = Detached("launch", argv, on_event=self._on_event, on_line=self._on_line,
                                log=log, events=events)
        self.jobs["launch"] = self.service
        self.log_line("console", f"launch: {shown(argv)}")
        self.log_line("console", f"launch: output in {log}")
        self._show_registration()
        self.run_worker(self._finish(self.service, "launch"), group="jobs")

    def attach(self) -> None:
        """At start: re-attach to the newest running service a console launched for this model."""
        if self.service is not None or not self.snapshot:
            return
        mine = [s for s in self._same_model_services() if s["from_console"]]
        if not mine:
            return
        found = _service(mine[-1])
        if not services.is_current(found):
            return
        self.launch = self.new_launch(spawned=found.create_time)
        self.service = Detached.attach(found, on_event=self._on_event, on_line=self._on_line)
        self.jobs["launch"] = self.service
        self.log_line("console", f"re-attached to pid {found.pid} {found.url or found.state}; log {found.log}")
        self.run_worker(self._finish(self.service, "launch"), group="jobs")

    # -- stop ---------------------------------------------------------------------------------

    def _do_stop(self) -> None:
        """Stop the service selected in the Services pane, and only while that pane has focus (a
        stray `s` elsewhere drains nothing); always after asking, No the default."""
        table = self._main("#services-table")
        if self.focused is not table:
            self.notify("s stops the service selected in the Services pane: tab to it, pick one, then s",
                        severity="warning")
            return
        row = table.selected()
        if row is None:
            self.notify("no service is running on this host")
            return
        mine = self.service is not None and self.service.running and row["pid"] == self.service.pid
        target = _service(row)
        origin = "this console" if mine else "a console" if row["from_console"] else "a shell"
        in_flight = row.get("in_flight")
        body = (f"pid {target.pid} {target.url or target.state}\nmodel {target.model}\nstarted by {origin}\n"
                f"requests in flight: {'unknown' if in_flight is None else in_flight} (they are drained first)\n"
                f"SIGTERM, then SIGKILL after {self.stop_timeout:.0f} s.")

        def confirmed(yes: bool | None) -> None:
            if not yes:
                self.log_line("console", f"stop: cancelled, pid {target.pid} left running")
            elif mine:
                self.log_line("console", f"stop: SIGTERM to pid {target.pid}")
                self.run_worker(self._stop(), group="stop")
            else:
                self._stop_other(target)

        self.push_screen(ConfirmScreen("Stop this service?", body), confirmed)

    async def _stop(self) -> None:
        if self.service:
            code = await self.service.stop(self.stop_timeout)
            if self.launch:
                self.launch.stopped = True
            self.status = f"service stopped (exit code {code})"
            self.log_line("console", self.status)
            self.notify(self.status, title="stopped")
            self._show_registration()
            self._topbar()

    @work(thread=True, group="stop")
    def _stop_other(self, target: services.Service) -> None:
        """SIGTERM a service this console does not hold, SIGKILL after the timeout; each signal
        only after re-checking that the pid is still that service."""
        if not services.send(target, signal.SIGTERM):
            self.call_from_thread(self.notify, f"pid {target.pid} is no longer that service: nothing sent",
                                  severity="warning")
            return
        self.call_from_thread(self.log_line, "console", f"stop: SIGTERM to pid {target.pid}")
        deadline = time.monotonic() + self.stop_timeout
        while services.is_current(target) and time.monotonic() < deadline:
            time.sleep(STOP_POLL)
        if services.send(target, signal.SIGKILL):
            self.call_from_thread(self.log_line, "console", f"stop: SIGKILL to pid {target.pid} (timeout)")
        self.call_from_thread(self.notify, f"stopped pid {target.pid}", title="stopped")
        self.call_from_thread(self.refresh_now)

    # -- quit ---------------------------------------------------------------------------------

    async def action_quit(self) -> None:
        """Textual's own quit (ctrl+q, the palette): the same dialog as `q`."""
        self.action_quit_console()

    def action_quit_console(self) -> None:
        if not (self.service and self.service.running):
            self.exit()
            return
        url = self.launch.url if self.launch and self.launch.url else ""
        what = f"pid {self.service.pid}" + (f" serving {url}" if url else " (registering)")
        if _log_of(self.service):
            what += f"\nlog {_log_of(self.service)}"

        def chosen(choice: str | None) -> None:
            if choice == LEAVE:
                self.exit()
            elif choice == STOP:
                self._stop_then_exit()

        self.push_screen(QuitScreen(what), chosen)

    @work(group="stop")
    async def _stop_then_exit(self) -> None:
        if self.service:
            await self.service.stop(self.stop_timeout)
        self.exit()

    def exit_message(self) -> str:
        """What `dsv4-console` prints when it leaves a service running."""
        if not (self.service and self.service.running):
            return ""
        url = self.launch.url if self.launch and self.launch.url else "(still registering)"
        log = f"; log {_log_of(self.service)}" if _log_of(self.service) else ""
        return f"dsv4-console: left the service running: pid {self.service.pid} {url}{log}"

    def _service_event(self, event: Event) -> None:
        if self.launch is None:
            return
        was_serving = bool(self.launch.url)
        self.launch.apply(event)
        if event.kind == "log" and event.message:
            self.log_line(event.phase, event.message)
        if self.launch.url and not was_serving:
            self.notify(f"serving {self.launch.url}", title="launch done")
            self._topbar()
        self._show_registration()


def _service(row: dict[str, Any]) -> services.Service:
    fields = set(services.Service.__dataclass_fields__)
    return services.Service(**{**{k: v for k, v in row.items() if k in fields}, "cmdline": tuple(row["cmdline"])})


def _log_of(worker: Any) -> str:
    """The log file of a detached service ("" for a piped worker or an unknown log)."""
    log = str(getattr(worker, "log", "") or "")
    return "" if log in ("", ".") else log
