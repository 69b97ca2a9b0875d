"""The console's long cache actions (first-run create, prepack, warm, purge): `dsv4 …` worker
processes whose progress (done/total, elapsed, ETA, what now) shows in the Sidecars pane, with
a notification when each ends. A mixin of `console.app.Dsv4Console`."""

from __future__ import annotations

import time
from typing import Any

from textual import work

from console import fmt
from console.collectors import default_preset
from console.eta import Progress, program_seconds
from console.launch_state import ProgramStates
from console.pane_sidecars import SidecarsPane
from console.screen_confirm import ConfirmScreen
from console.workers import Worker, dsv4
from runtime.events import Event
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
        if (self.settings.model_dir / INDEX_NAME).is_file():
            return True
        self.notify(f"no checkpoint at {self.settings.model_dir}", severity="error")
        return False

    def _start(self, name: str, argv: list[str], progress: Progress | None = None) -> Worker:
        w = Worker(name, argv, on_event=self._on_event, on_line=self._on_line)
        self.jobs[name] = w
        self.log_line("console", f"{name}: {' '.join(argv[2:])}")
        self.pools.pop(name, None)
        if progress is not None:
            self.progress[name] = progress
            self.show_job(name)
        return w

    def show_job(self, name: str) -> None:
        p = self.progress.get(name)
        pane = self._main(SidecarsPane)
        if p is None:
            pane.job("")
        else:
            pane.job(p.line(), p.done, p.total)

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
            self._main(SidecarsPane).job("")
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
                                 f"{self.settings.model_dir}")
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
        argv = dsv4("prepack", str(self.settings.model_dir), "--ranks", str(self.settings.ranks),
                    "--events", "-")
        from store import sidecar as sc  # lazily: keeps the console's first paint fast

        existing = sc.default_sidecar_path(self.settings.model_dir, self.settings.ranks)

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
        from store import sidecar as sc

        s = self.settings
        path = sc.default_sidecar_path(s.model_dir, s.ranks)
        if path.is_file():
            known = pagecache.read_throughput()
            argv = dsv4("sidecar", "warm", str(path), "--events", "-")
            p = Progress(f"warm {path.name}", "bytes", rate=known.bytes_per_s if known.measured else None)
            if await self._finish(self._start("warm", argv, p), "warm (read)") != 0:
                return
        else:
            self.log_line("console", f"warm: no sidecar at {path}; prepack first (p). Compiling programs only")
        argv = dsv4("compile", str(s.model_dir), "--kernel-cache-dir", str(s.kernel_cache_dir),
                    "--device", s.device, "--backend", s.backend, "--max-seq", str(s.max_seq), "--events", "-")
        planned = self.snapshot.programs.entries if self.snapshot else ()
        p = Progress("compile", "programs", items=program_seconds(planned))
        await self._finish(self._start("warm", argv, p), "warm (compile)")

    def _do_purge(self) -> None:
        self._purge_ask()

    @work(thread=True, group="purge")
    def _purge_ask(self) -> None:
        """A fresh plan of this checkpoint, and what it calls stale or corrupt: each file and why."""
        from runtime import purge

        plan, _ = self.collectors.plan()
        chosen = purge.targets(plan) if plan is not None else []
        self.call_from_thread(self._purge_confirm, plan, chosen)

    def _purge_confirm(self, plan, chosen: list) -> None:
        if not chosen:
            self.notify("nothing to purge: the plan calls no program entry or sidecar stale or corrupt")
            return
        nbytes = sum(t.size_bytes for t in chosen)
        programs = sum(t.kind == "program" for t in chosen)
        lines = [f"{programs} program entries and {len(chosen) - programs} sidecars, {fmt.size(nbytes)}, "
                 "that the plan of this checkpoint calls stale or corrupt:"]
        lines += [f"  {t.path}\n    {t.reason} ({fmt.size(t.size_bytes)})" for t in chosen[:20]]
        if len(chosen) > 20:
            lines.append(f"  … and {len(chosen) - 20} more")

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._purge(plan, chosen)
            else:
                self.log_line("console", "purge: cancelled, nothing deleted")

        self.push_screen(ConfirmScreen("Delete these?", "\n".join(lines)), confirmed)

    @work(thread=True, group="purge")
    def _purge(self, plan, chosen: list) -> None:
        from runtime import purge

        try:  # deletes only what a fresh look at the plan still calls stale or corrupt
            done = purge.purge(plan, chosen)
        except Exception as e:
            self.call_from_thread(self.notify, f"purge: {e}", title="failed", severity="error")
            return
        for t in done:
            self.call_from_thread(self.log_line, "console", f"purge: deleted {t.line()}")
        message = f"purge: deleted {len(done)} of {len(chosen)} ({fmt.size(sum(t.size_bytes for t in done))})"
        self.call_from_thread(self.log_line, "console", message)
        self.call_from_thread(self.notify, message, title="done")
        self.call_from_thread(self.refresh_now)
