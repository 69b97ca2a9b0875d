"""The console's long cache actions (first-run create, prepack, warm, purge): `dsv4 …` worker
processes whose progress (done/total, elapsed, ETA, what now) shows in the Sidecars pane (a
compile's in the Programs pane, each program's row saying where it is), with a notification
when each ends."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from textual.app import App

from console import fmt
from console.data.collectors import default_preset
from console.data.eta import Progress, program_seconds
from console.data.launch_state import ProgramStates
from console.tui.panes.programs import ProgramsPane
from console.tui.panes.sidecars import SidecarsPane
from console.tui.screens.confirm import ConfirmScreen
from console.tui.workers import Worker, dsv4, shown
from runtime.events import Event
from runtime.launch.spec import COMPILE, PREPACK
from store import sidecar as sc
from store.checkpoint import INDEX_NAME


class JobControl:
    """Every job this console runs (its service too, under "launch"), and their progress."""

    def __init__(self, app: App):
        self.app = app
        self.jobs: dict[str, Any] = {}
        self.progress: dict[str, Progress] = {}
        self.pools: dict[str, ProgramStates] = {}
        self.failures: list[Event] = []

    @property
    def spec(self):
        return self.app.spec

    @property
    def snapshot(self):
        return self.app.snapshot

    def running(self) -> list[str]:
        return [n for n, w in self.jobs.items() if w.running]

    def _busy(self, name: str) -> bool:
        job = self.jobs.get(name)
        if job and job.running:
            self.app.notify(f"{name} is already running (pid {job.pid})", severity="warning")
            return True
        return False

    def model_ready(self) -> bool:
        if (self.spec.model / INDEX_NAME).is_file():
            return True
        self.app.notify(f"no checkpoint at {self.spec.model}", severity="error")
        return False

    def _start(self, name: str, argv: list[str], progress: Progress | None = None) -> Worker:
        w = Worker(name, argv, **self.app.worker_callbacks())
        self.jobs[name] = w
        self.app.log_line("console", f"{name}: {shown(argv)}")
        self.pools.pop(name, None)
        if progress is not None:
            self.progress[name] = progress
            self.show_job(name)
        return w

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

    def failed(self, worker: Worker, event: Event) -> None:
        """The parent's verdict on a worker that died: its line, its last stderr lines."""
        self.failures.append(event)
        self.app.log_line("error", event.message or "failed")
        for line in event.detail.get("stderr", [])[-5:]:
            self.app.log_line("error", f"  {line}")
        self.app.notify(event.message or "failed", title="failed", severity="error", timeout=8)

    def event(self, worker: Worker, event: Event) -> None:
        p = self.progress.get(worker.name)
        d = event.detail
        if event.kind == "progress" and p is not None:
            now = d.get("group") or d.get("file") or ""
            order = self._program_order()
            if "program" in d and len(order) == event.total and event.done < event.total:
                now = f"preparing {order[int(event.done)]}"  # progress arrives as each program ends
            p.update(event.done, event.total, now=now, item=d.get("program", ""))
            self.show_job(worker.name)
        elif event.kind == "start" and p is not None and isinstance(d.get("total"), int | float):
            p.update(0, d["total"])
            self.show_job(worker.name)
        elif event.kind == "log" and p is not None and ProgramStates.applies(d):
            # a compile pool's per-program events (`dsv4 compile --events`): done, what compiles now
            pool = self.pools.setdefault(worker.name, ProgramStates())
            pool.feed(d, event.ts)
            p.pool = pool
            p.items.update(pool.expected)
            p.finished |= pool.finished
            p.update(len(pool.finished), now=pool.now)
            self.show_job(worker.name)
        if event.message and event.kind != "progress":
            self.app.log_line(worker.name, event.message)

    def _program_order(self) -> list[str]:
        """The programs in the order a launch prepares them (the plan's)."""
        return [p.program for p in self.snapshot.programs.entries] if self.snapshot else []

    async def finish(self, worker: Worker, what: str = "") -> int | None:
        """Run `worker` to its end: its exit said in the log, a job's progress line cleared and
        its success notified (a service's end is the service control's to say)."""
        self.app.topbar()
        code = await worker.run()
        self.app.log_line("console", f"{worker.name}: {'ended' if code is None else f'exit code {code}'}")
        p = self.progress.pop(worker.name, None)
        if worker is not self.app.service:
            pane = self.job_pane(p)
            if pane is not None:
                pane.job("")
            if code == 0:
                took = fmt.duration(time.monotonic() - p.started) if p else ""
                self.app.notify(f"{what or worker.name} done{' in ' + took if took else ''}", title="done")
        self.app.topbar()
        self.app.refresh_now()
        return code

    def create(self) -> None:
        if self._busy("create"):
            return
        self.app.log_line("console", f"creating the embedded default checkpoint ({default_preset()}) at "
                                     f"{self.spec.model}")
        # its progress as events on stdout (bytes written of the total, the tensor now), as every job's
        w = self._start("create", dsv4("check", "--events", "-"),
                        Progress(f"creating the default {default_preset()} checkpoint (first run)", unit="bytes"))
        self.app.run_worker(self._created(w), group="jobs")

    async def _created(self, w: Worker) -> None:
        if await self.finish(w, "default checkpoint") == 0:
            self.app.notify("the default checkpoint is ready: w warms it (reads the sidecar, compiles the "
                            "programs), then l launches", title="next", timeout=15)
            self.app.log_line("console", "next: w warms the checkpoint (compiles its programs), then l launches")

    def _pack_rate(self) -> float | None:
        """Bytes per second packed by earlier prepacks (recorded in each sidecar's metadata)."""
        wanted = self.snapshot.sidecars.wanted if self.snapshot else None
        return wanted.size_bytes / wanted.pack_seconds if wanted and wanted.pack_seconds and wanted.size_bytes else None

    def prepack(self) -> None:
        if self._busy("prepack") or not self.model_ready():
            return
        argv = dsv4("prepack", *self.spec.with_(events="-").argv(PREPACK))
        existing = sc.default_sidecar_path(self.spec.model, self.spec.ranks)

        def go(extra: list[str]) -> None:
            w = self._start("prepack", [*argv, *extra], Progress("prepack", "bytes", rate=self._pack_rate()))
            self.app.run_worker(self.finish(w, "prepack"), group="jobs")

        if not existing.exists():
            go([])
            return
        self.app.push_screen(ConfirmScreen("Replace the sidecar?",
                                       f"{existing} ({fmt.size(existing.stat().st_size)}) exists; prepack "
                                       "writes a new one and replaces it in one rename."),
                         lambda yes: go(["--force"]) if yes else None)

    def warm(self) -> None:
        if self._busy("warm") or not self.model_ready():
            return
        self.app.run_worker(self._warm(), group="jobs")

    async def _warm(self) -> None:
        from store import pagecache

        s = self.spec
        path = sc.default_sidecar_path(s.model, s.ranks)
        if path.is_file():
            known = pagecache.read_throughput()
            argv = dsv4("sidecar", "warm", str(path), "--events", "-")
            p = Progress(f"warm {path.name}", "bytes", rate=known.bytes_per_s if known.measured else None)
            if await self.finish(self._start("warm", argv, p), "warm (read)") != 0:
                return
        else:
            self.app.log_line("console", f"warm: no sidecar at {path}; prepack first (p). Compiling programs only")
        argv = dsv4("compile", *s.with_(events="-").argv(COMPILE))  # exactly the programs a launch of s needs
        planned = self.snapshot.programs.entries if self.snapshot else ()
        p = Progress("compile", "programs", items=program_seconds(planned))
        await self.finish(self._start("warm", argv, p), "warm (compile)")

    def purge(self) -> None:
        self.app.run_worker(self._purge_ask, thread=True, group="purge")

    def _purge_scope(self) -> str:
        """What `x` purges: in the kernel cache view, every entry that can never be used again;
        elsewhere what the plan of this checkpoint calls stale or corrupt (runtime.launch.purge)."""
        from runtime.launch import purge

        pane = self.app.pane(ProgramsPane)
        return purge.CACHE if pane is not None and pane.viewing_cache is True else purge.PLAN

    def _purge_ask(self) -> None:
        """A fresh plan of this checkpoint, and what the purge rules allow: each file and why."""
        from runtime.launch import purge

        scope = self.app.call_from_thread(self._purge_scope)
        plan, _ = self.app.collectors.plan()
        chosen = purge.targets(plan, scope) if plan is not None else []
        self.app.call_from_thread(self._purge_confirm, plan, chosen, scope)

    def _purge_confirm(self, plan, chosen: list, scope: str = "plan") -> None:
        which = ("that the plan of this checkpoint calls stale or corrupt" if scope == "plan" else
                 "that the kernel cache calls stale, corrupt, quarantined or abandoned")
        if not chosen:
            self.app.notify(f"nothing to purge: no program entry or sidecar {which.removeprefix('that ')}")
            return
        nbytes = sum(t.size_bytes for t in chosen)
        programs = sum(t.kind == "program" for t in chosen)
        lines = [f"{programs} program entries and {len(chosen) - programs} sidecars, {fmt.size(nbytes)}, "
                 f"{which}:"]
        lines += [f"  {t.path}\n    {t.reason} ({fmt.size(t.size_bytes)})" for t in chosen[:20]]
        if len(chosen) > 20:
            lines.append(f"  … and {len(chosen) - 20} more")

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.app.run_worker(partial(self._purge, plan, chosen, scope), thread=True, group="purge")
            else:
                self.app.log_line("console", "purge: cancelled, nothing deleted")

        self.app.push_screen(ConfirmScreen("Delete these?", "\n".join(lines)), confirmed)

    def _purge(self, plan, chosen: list, scope: str) -> None:
        from runtime.launch import purge

        app = self.app
        try:  # deletes only what a fresh look still allows
            done = purge.purge(plan, chosen, scope)
        except Exception as e:
            app.call_from_thread(app.notify, f"purge: {e}", title="failed", severity="error")
            return
        for t in done:
            app.call_from_thread(app.log_line, "console", f"purge: deleted {t.line()}")
        message = f"purge: deleted {len(done)} of {len(chosen)} ({fmt.size(sum(t.size_bytes for t in done))})"
        app.call_from_thread(app.log_line, "console", message)
        app.call_from_thread(app.notify, message, title="done")
        app.call_from_thread(app.refresh_now)
