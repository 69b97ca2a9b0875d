"""The console's long cache actions (first-run create, prepack, warm, purge): `dsv4 …` worker
processes whose progress (done/total, elapsed, ETA, what now) shows in the Sidecars pane (a
compile's in the Programs pane, each program's row saying where it is), with a notification
when each ends. A mixin of `console.tui.app.Dsv4Console`."""

from __future__ import annotations

import time
from typing import Any

from textual import work

from console.tui import fmt
from console.tui.data.collectors import default_preset
from console.tui.data.eta import Progress, program_seconds
from console.tui.data.launch_state import ProgramStates
from console.tui.panes.programs import ProgramsPane
from console.tui.panes.sidecars import SidecarsPane
from console.tui.screens.confirm import ConfirmScreen
from console.tui.workers import Worker, dsv4, shown
from runtime.events import Event
from runtime.launch.spec import COMPILE, PREPACK
from store import sidecar as sc
from store.checkpoint import INDEX_NAME


class JobActions:
    jobs: dict[str, Any]
    progress: dict[str, Progress]
    pools: dict[str, ProgramStates]

    def _busy(self, name: str) -> bool:
        job = self.jobs.get(name)
        if job and job.running:
            self.notify(f"{name} is already running (pid {job.pid})", severity="warning")
            return True
        return False

    def _model_ready(self) -> bool:
        if (self.spec.model / INDEX_NAME).is_file():
            return True
        self.notify(f"no checkpoint at {self.spec.model}", severity="error")
        return False

    def _start(self, name: str, argv: list[str], progress: Progress | None = None) -> Worker:
        w = Worker(name, argv, on_event=self._on_event, on_line=self._on_line)
        self.jobs[name] = w
        self.log_line("console", f"{name}: {shown(argv)}")
        self.pools.pop(name, None)
        if progress is not None:
            self.progress[name] = progress
            self.show_job(name)
        return w

    def _job_pane(self, p: Progress | None):
        """Where a job's progress shows: a compile in Programs (beside its rows), the rest in Sidecars."""
        return self._main(ProgramsPane) if p is not None and p.unit == "programs" else self._main(SidecarsPane)

    def show_job(self, name: str) -> None:
        p = self.progress.get(name)
        if p is None:
            self._main(SidecarsPane).job("")
            self._main(ProgramsPane).job("")
        elif p.unit == "programs":
            pool = self.pools.get(name)
            self._main(ProgramsPane).job(p.line(), p.done, p.total, pool.states if pool else None)
        else:
            self._main(SidecarsPane).job(p.line(), p.done, p.total)

    def tick_jobs(self) -> None:
        """Once a second while something runs: elapsed and ETA move even between events."""
        for name, job in self.jobs.items():
            if job.running and name in self.progress:
                self.show_job(name)

    def _job_event(self, worker: Worker, event: Event) -> None:
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
        elif event.kind == "log" and p is not None and ProgramStates.applies(d):
            # a compile pool's per-program events (`dsv4 compile --events`): done, what compiles now
            pool = self.pools.setdefault(worker.name, ProgramStates())
            pool.feed(d)
            p.items.update(pool.expected)
            p.finished |= pool.finished
            p.update(len(pool.finished), now=pool.now)
            self.show_job(worker.name)
        if event.message and event.kind != "progress":
            self.log_line(worker.name, event.message)

    def _program_order(self) -> list[str]:
        """The programs in the order the last launch of this model prepared them."""
        prev = self.snapshot.registration.previous if self.snapshot else None
        return list((prev or {}).get("phases", {}).get("programs", {}).get("programs") or {})

    async def _finish(self, worker: Worker, what: str = "") -> int:
        self._topbar()
        code = await worker.run()
        self.log_line("console", f"{worker.name}: exit code {code}")
        p = self.progress.pop(worker.name, None)
        if worker is not self.service:
            self._job_pane(p).job("")
            if code == 0:
                took = fmt.duration(time.monotonic() - p.started) if p else ""
                self.notify(f"{what or worker.name} done{' in ' + took if took else ''}", title="done")
        self._topbar()
        self.refresh_now()
        return code

    def _do_create(self) -> None:
        if self._busy("create"):
            return
        self.log_line("console", f"creating the embedded default checkpoint ({default_preset()}) at "
                                 f"{self.spec.model}")
        w = self._start("create", dsv4("check"), Progress(f"creating the default {default_preset()} "
                                                          "checkpoint (first run)"))
        self.run_worker(self._finish(w, "default checkpoint"), group="jobs")

    def _pack_rate(self) -> float | None:
        """Bytes per second packed by earlier prepacks (recorded in each sidecar's metadata)."""
        rows = self.snapshot.sidecars.sidecars if self.snapshot else ()
        rates = [r["size_bytes"] / r["pack_seconds"] for r in rows if r.get("pack_seconds") and r.get("size_bytes")]
        return max(rates) if rates else None

    def _do_prepack(self) -> None:
        if self._busy("prepack") or not self._model_ready():
            return
        argv = dsv4("prepack", *self.spec.with_(events="-").argv(PREPACK))
        existing = sc.default_sidecar_path(self.spec.model, self.spec.ranks)

        def go(extra: list[str]) -> None:
            w = self._start("prepack", [*argv, *extra], Progress("prepack", "bytes", rate=self._pack_rate()))
            self.run_worker(self._finish(w, "prepack"), group="jobs")

        if not existing.exists():
            go([])
            return
        self.push_screen(ConfirmScreen("Replace the sidecar?",
                                       f"{existing} ({fmt.size(existing.stat().st_size)}) exists; prepack "
                                       "writes a new one and replaces it in one rename."),
                         lambda yes: go(["--force"]) if yes else None)

    def _do_warm(self) -> None:
        if self._busy("warm") or not self._model_ready():
            return
        self.run_worker(self._warm(), group="jobs")

    async def _warm(self) -> None:
        from store import pagecache

        s = self.spec
        path = sc.default_sidecar_path(s.model, s.ranks)
        if path.is_file():
            known = pagecache.read_throughput()
            argv = dsv4("sidecar", "warm", str(path), "--events", "-")
            p = Progress(f"warm {path.name}", "bytes", rate=known.bytes_per_s if known.measured else None)
            if await self._finish(self._start("warm", argv, p), "warm (read)") != 0:
                return
        else:
            self.log_line("console", f"warm: no sidecar at {path}; prepack first (p). Compiling programs only")
        argv = dsv4("compile", *s.with_(events="-").argv(COMPILE))  # exactly the programs a launch of s needs
        planned = self.snapshot.programs.entries if self.snapshot else ()
        p = Progress("compile", "programs", items=program_seconds(planned))
        await self._finish(self._start("warm", argv, p), "warm (compile)")

    def _do_purge(self) -> None:
        self._purge_ask()

    def _purge_scope(self) -> str:
        """What `x` purges: in the kernel cache view, every entry that can never be used again;
        elsewhere what the plan of this checkpoint calls stale or corrupt (runtime.launch.purge)."""
        from runtime.launch import purge

        return purge.CACHE if self._main(ProgramsPane).viewing_cache is True else purge.PLAN

    @work(thread=True, group="purge")
    def _purge_ask(self) -> None:
        """A fresh plan of this checkpoint, and what the purge rules allow: each file and why."""
        from runtime.launch import purge

        scope = self.call_from_thread(self._purge_scope)
        plan, _ = self.collectors.plan()
        chosen = purge.targets(plan, scope) if plan is not None else []
        self.call_from_thread(self._purge_confirm, plan, chosen, scope)

    def _purge_confirm(self, plan, chosen: list, scope: str = "plan") -> None:
        which = ("that the plan of this checkpoint calls stale or corrupt" if scope == "plan" else
                 "that the kernel cache calls stale, corrupt, quarantined or abandoned")
        if not chosen:
            self.notify(f"nothing to purge: no program entry or sidecar {which.removeprefix('that ')}")
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
                self._purge(plan, chosen, scope)
            else:
                self.log_line("console", "purge: cancelled, nothing deleted")

        self.push_screen(ConfirmScreen("Delete these?", "\n".join(lines)), confirmed)

    @work(thread=True, group="purge")
    def _purge(self, plan, chosen: list, scope: str) -> None:
        from runtime.launch import purge

        try:  # deletes only what a fresh look still allows
            done = purge.purge(plan, chosen, scope)
        except Exception as e:
            self.call_from_thread(self.notify, f"purge: {e}", title="failed", severity="error")
            return
        for t in done:
            self.call_from_thread(self.log_line, "console", f"purge: deleted {t.line()}")
        message = f"purge: deleted {len(done)} of {len(chosen)} ({fmt.size(sum(t.size_bytes for t in done))})"
        self.call_from_thread(self.log_line, "console", message)
        self.call_from_thread(self.notify, message, title="done")
        self.call_from_thread(self.refresh_now)
