"""The long actions on the host the panes show (this one, or a fleet host opened from the fleet
screen): warm, prepack, compile and purge start here and run through the fleet's runner
(`console.fleet.runner`, the very code the fleet screen and `dsv4 fleet` run), on that host's
own `dsv4`; their progress (done/total, elapsed, ETA, what now) shows in the Sidecars pane (a
compile's in the Programs pane, each program's row saying where it is), their lines in the log,
a notification when each ends. The first run's default checkpoint (`create`) is an action too,
this host's; while it runs the Registration pane says what the next launch waits for, and once it
ends, what the plan says."""

from __future__ import annotations

import shlex
from typing import Any

from rich.markup import escape
from textual.app import App

from console import fmt
from console.data.collectors import default_preset
from console.data.eta import Progress
from console.data.launch_state import ProgramStates
from console.fleet import actions as A
from console.fleet.runner import HostJob
from console.tui.panes.programs import ProgramsPane
from console.tui.panes.sidecars import SidecarsPane
from console.tui.screens.confirm import ConfirmScreen
from runtime.events import Event
from store import timeline as T
from store.checkpoint import INDEX_NAME

HOST_ACTIONS = ("warm", "prepack", "compile", "purge")  # what the panes' keys start on their host
SHOWN = (*HOST_ACTIONS, "create")  # the jobs whose progress the panes show


class JobControl:
    """Every job on the shown host (its service too, under "launch"), and their progress."""

    def __init__(self, app: App):
        self.app = app
        self.jobs: dict[str, Any] = {}  # action → its command now (what `app.jobs` shows)
        self.progress: dict[str, Progress] = {}
        self.pools: dict[str, ProgramStates] = {}
        self.failures: list[Event] = []
        runner = app.session.runner
        runner.listeners.append(self._changed)
        app.session.log.listeners.append(self._said)

    @property
    def spec(self):
        return self.app.spec

    @property
    def snapshot(self):
        return self.app.snapshot

    @property
    def host(self):
        return self.app.host

    def running(self) -> list[str]:
        return [n for n, w in self.jobs.items() if w.running]

    def _busy(self, name: str) -> bool:
        job = self.jobs.get(name)
        if job and job.running:
            self.app.notify(f"{name} is already running (pid {job.pid})", severity="warning")
            return True
        return False

    def model_ready(self) -> bool:
        """This host's checkpoint is there (another host's own `dsv4` says so when it is not)."""
        if self.host is None or self.host.kind != "local" or (self.spec.model / INDEX_NAME).is_file():
            return True
        self.app.notify(f"no checkpoint at {self.spec.model}", severity="error")
        return False

    # -- what the runner tells ------------------------------------------------------------------

    def _changed(self, host: str, job: HostJob, event: Event | None) -> None:
        """A job of the runner moved: the shown host's shows in its panes."""
        if self.host is None or host != self.host.name or job.action not in SHOWN:
            return
        if job.command is not None:
            self.jobs[job.action] = job.command
        if job.progress is not None:
            self.progress[job.action] = job.progress
        if job.pool is not None:
            self.pools[job.action] = job.pool
        if job.outcome:
            self._ended(job)
        else:
            self.show_job(job.action)

    def _said(self, event: T.TimelineEvent) -> None:
        """The fleet log's events about the shown host, in its Log pane."""
        if self.host is None or event.host != self.host.name:
            return
        if event.kind == T.LINE:
            self.app.log_line(event.action or event.host, event.text)
        elif event.kind == T.STEP:
            self.app.log_line("console", f"{event.action}: {event.text}")

    def _ended(self, job: HostJob) -> None:
        name = job.action
        p = self.progress.pop(name, None)
        pane = self.job_pane(p)
        if pane is not None:
            pane.job("")
        self.app.log_line("console", f"{name}: {'done' if job.ok else job.outcome}")
        if job.ok and name == "create":
            self.app.notify("the default checkpoint is ready: w warms it (reads the sidecar, compiles the "
                            "programs), then l launches", title="next", timeout=15)
            self.app.log_line("console", "next: w warms the checkpoint (compiles its programs), then l launches")
        elif job.ok:
            self.app.notify(f"{name} done in {fmt.duration(job.took or 0)}", title="done")
        else:
            failure = job.failure or Event(name, "error", message=f"{name}: {job.outcome}", detail={})
            self.failed(failure)
        self.app.show_registration()  # a job that ended no longer holds the next launch back
        self.app.topbar()
        if name == "create" and self.host is not None:
            self.host.replan()  # the checkpoint the plan failed on is there now
        self.app.refresh_now()

    # -- starting -------------------------------------------------------------------------------

    def start(self, action: str) -> None:
        """warm, prepack or compile on the shown host; prepack asks before it replaces a sidecar."""
        if self._busy(action) or not self.model_ready():
            return
        wanted = self.snapshot.sidecars.wanted if self.snapshot else None
        if action == "prepack" and wanted is not None and wanted.size_bytes:
            self.app.push_screen(ConfirmScreen("Replace the sidecar?", f"{wanted.path} ({fmt.size(wanted.size_bytes)}) "
                                               "exists; prepack writes a new one and replaces it in one rename."),
                                 lambda yes: self._run(action) if yes else None)
            return
        self._run(action)

    def _run(self, action: str, chosen: list[str] | None = None, scope: str = A.PLAN_SCOPE) -> None:
        host = self.host.name
        steps = [] if action == "purge" else A.steps(action, self.spec, self.snapshot)
        self.app.log_line("console", f"{action} on {self.host.where}" + "".join(
            f"; {shlex.join(['dsv4', *s.args])}" for s in steps))
        self.app.run_worker(self.app.session.runner.run(action, [host], chosen={host: chosen or []}, scope=scope),
                            group="jobs")
        self.app.topbar()

    def job_pane(self, p: Progress | None):
        """Where a job's progress shows: a compile in Programs (beside its rows), the rest in Sidecars."""
        return self.app.pane(ProgramsPane if p is not None and p.unit == "programs" else SidecarsPane)

    def show_job(self, name: str) -> None:
        p = self.progress.get(name)
        programs, sidecars = self.app.pane(ProgramsPane), self.app.pane(SidecarsPane)
        if p is None:
            for pane in (programs, sidecars):
                if pane is not None:
                    pane.job("")
        elif p.unit == "programs":
            pool = self.pools.get(name)
            if programs is not None:
                programs.job(p.line(), p.done, p.total, pool.states if pool else None)
        elif sidecars is not None:
            sidecars.job(p.line(), p.done, p.total)
        if name == "create":  # Registration says the creation's progress too, in step with its pane
            self.app.show_registration()

    def tick_jobs(self) -> None:
        """Once a second while something runs: elapsed and ETA move even between events."""
        for name, job in self.jobs.items():
            if job.running and name in self.progress:
                self.show_job(name)

    def failed(self, event: Event) -> None:
        """A job that failed: its line, its last stderr lines."""
        self.failures.append(event)
        self.app.log_line("error", event.message or "failed")
        for line in event.detail.get("stderr", [])[-5:]:
            self.app.log_line("error", f"  {line}")
        self.app.notify(escape(event.message or "failed"), title="failed", severity="error", timeout=8)

    # -- purge: what the host's plan allows, each file and why, then only those -------------------

    def purge(self) -> None:
        if self._busy("purge"):
            return
        scope = self._purge_scope()
        host = self.host.name

        async def ask() -> None:
            listed = await self.app.session.runner.listing([host], scope)
            self._purge_confirm(listed.get(host), scope)

        self.app.run_worker(ask(), group="jobs")

    def _purge_scope(self) -> str:
        """What `x` purges: in the kernel cache view, every entry that can never be used again;
        elsewhere what the plan of this checkpoint calls stale or corrupt (runtime.launch.purge)."""
        pane = self.app.pane(ProgramsPane)
        return A.CACHE_SCOPE if pane is not None and pane.viewing_cache is True else A.PLAN_SCOPE

    def _purge_confirm(self, chosen: list | None, scope: str) -> None:
        if chosen is None:
            return  # the listing failed: its job said why
        which = ("that the plan of this checkpoint calls stale or corrupt" if scope == A.PLAN_SCOPE else
                 "that the kernel cache calls stale, corrupt, quarantined or abandoned")
        if not chosen:
            self.app.notify(f"nothing to purge: no program entry or sidecar {which.removeprefix('that ')}")
            return
        nbytes = sum(t.size_bytes for t in chosen)
        programs = sum(t.kind == "program" for t in chosen)
        lines = [f"{programs} program entries and {len(chosen) - programs} sidecars, {fmt.size(nbytes)}, {which}:"]
        lines += [f"  {t.path}\n    {t.reason} ({fmt.size(t.size_bytes)})" for t in chosen[:20]]
        if len(chosen) > 20:
            lines.append(f"  … and {len(chosen) - 20} more")

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._run("purge", [t.path for t in chosen], scope)
            else:
                self.app.log_line("console", "purge: cancelled, nothing deleted")

        self.app.push_screen(ConfirmScreen("Delete these?", escape("\n".join(lines))), confirmed)

    # -- the first run: this host's embedded default checkpoint ----------------------------------

    def create(self) -> None:
        if self._busy("create"):
            return
        self.app.log_line("console", f"creating the embedded default checkpoint ({default_preset()}) at "
                                     f"{self.spec.model}")
        self._run("create")

    async def finish(self, worker: Any, what: str = "") -> None:
        """Follow the held service (`console.tui.detached.Detached`) until its process is gone:
        said in the log (how it ended is the service control's to say)."""
        self.app.topbar()
        await worker.run()
        self.app.log_line("console", f"{what or worker.name}: the service's process is gone")
        self.app.topbar()
        self.app.refresh_now()
