"""`dsv4-console`: the Textual operations console (program cache, sidecars, host, device,
registration, log) with the long actions run as `dsv4 …` worker processes.

Collectors (console.collectors) return snapshots off the UI thread; panes render them. Every
mutating action goes through one guard (`action_mutate`), which `--readonly` closes. No torch:
the workers import it, the console never does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid
from textual.css.query import NoMatches
from textual.widgets import Footer, Input, Static

from console import fmt
from console.collectors import Collectors, Settings, Snapshot, default_model_dir, default_preset
from console.launch_state import LaunchState
from console.pane_device import DevicePane
from console.pane_host import HostPane
from console.pane_log import LogPane
from console.pane_programs import ProgramsPane
from console.pane_registration import RegistrationPane
from console.pane_sidecars import SidecarsPane
from console.screen_confirm import ConfirmScreen
from console.screen_help import HelpScreen
from console.screen_quit import LEAVE, STOP, QuitScreen
from console.workers import Worker, dsv4
from runtime.events import Event
from store import sidecar as sc

MUTATING = frozenset({"prepack", "purge", "warm", "launch", "stop", "create"})
PURGE_PROGRAM_STATES = ("stale", "corrupt")
PURGE_SIDECAR_REASONS = ("stale", "corrupt", "names")
_COMPILE_LINE = re.compile(r"^\[(\d+)/(\d+)\] (\S+): (\S+)")


class Dsv4Console(App):
    CSS_PATH = "app.tcss"
    TITLE = "dsv4-console"
    AUTO_FOCUS = "#programs-table"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit_console", "Quit", id="quit", tooltip="quit (asks about a service started here)"),
        Binding("question_mark", "help", "Help", key_display="?", id="help", tooltip="this screen"),
        Binding("r", "refresh", "Refresh", id="refresh", tooltip="collect every pane now"),
        Binding("slash", "filter", "Filter", key_display="/", id="filter",
                tooltip="filter programs, sidecars and log lines (esc closes)"),
        Binding("p", "mutate('prepack')", "Prepack", id="prepack",
                tooltip="pack the checkpoint into a sidecar (worker; progress in Sidecars)"),
        Binding("w", "mutate('warm')", "Warm", id="warm",
                tooltip="read the sidecar into the page cache, then compile missing programs"),
        Binding("x", "mutate('purge')", "Purge", id="purge",
                tooltip="delete stale/corrupt program entries and stale sidecars (confirm)"),
        Binding("l", "mutate('launch')", "Launch", id="launch",
                tooltip="dsv4 serve --events - (phases stream into Registration)"),
        Binding("s", "mutate('stop')", "Stop", id="stop", tooltip="SIGTERM the service, kill after a timeout"),
    ]

    def __init__(self, settings: Settings, *, collectors: Any | None = None, readonly: bool = False,
                 interval: float = 2.0, watch: bool = True, create_default: bool = True,
                 stop_timeout: float = 10.0):
        super().__init__()
        self.settings = settings
        self.collectors = collectors or Collectors(settings)
        self.readonly = readonly
        self.interval = interval
        self.watch_files = watch
        self.create_default = create_default
        self.stop_timeout = stop_timeout
        self.snapshot: Snapshot | None = None
        self.jobs: dict[str, Worker] = {}
        self.failures: list[Event] = []
        self.refused: list[str] = []
        self.launch: LaunchState | None = None
        self.service: Worker | None = None
        self.needle = ""
        self.status = ""
        self._watching: tuple[str, ...] = ()
        self._watch_stop: asyncio.Event | None = None
        self.first_paint: float | None = None

    # -- layout -------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static(id="topbar")
        with Grid(id="panes"):
            yield ProgramsPane(id="programs")
            yield HostPane(id="host")
            yield SidecarsPane(id="sidecars")
            yield DevicePane(id="device")
            yield RegistrationPane(id="registration")
            yield LogPane(id="logpane")
        yield Input(placeholder="filter (esc closes, empty clears)", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        self._topbar()
        # collect after the first paint: the empty screen shows at once, data follows
        self.call_after_refresh(self.refresh_now)
        if self.interval > 0:
            self.set_interval(self.interval, self.refresh_now)
        self.call_after_refresh(self._painted)
        if self.create_default and self._needs_default():
            self.action_mutate("create")

    def _painted(self) -> None:
        self.first_paint = time.monotonic()

    def _needs_default(self) -> bool:
        return (self.settings.model_dir == default_model_dir()
                and not (self.settings.model_dir / sc.INDEX_NAME).is_file())

    def _topbar(self) -> None:
        s = self.settings
        parts = [f"[b]dsv4-console[/]  model [b]{s.model_dir}[/]",
                 f"device {self.collectors.device_kind if hasattr(self.collectors, 'device_kind') else s.device}",
                 f"backend {s.backend}"]
        if self.readonly:
            parts.append("[b reverse] READ-ONLY [/]")
        if self.service and self.service.running:
            url = self.launch.url if self.launch else ""
            parts.append(f"[green]service pid {self.service.pid}{' ' + url if url else ''}[/]")
        running = [n for n, w in self.jobs.items() if w.running and w is not self.service]
        if running:
            parts.append(f"[yellow]working: {', '.join(running)}[/]")
        self._main("#topbar", Static).update("  │  ".join(parts))

    # -- snapshots ----------------------------------------------------------------------------

    def refresh_now(self) -> None:
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

    def _main(self, selector, expect_type=None):
        """A widget of the main screen, or a stand-in that ignores calls while it is not there
        (first run, shutdown): a late snapshot or worker line must never crash the console."""
        try:
            screen = self.screen_stack[0]
            return screen.query_one(selector) if expect_type is None else screen.query_one(selector, expect_type)
        except (NoMatches, IndexError):
            return _ABSENT

    def apply_snapshot(self, snap: Snapshot, force: bool = False) -> None:
        old, self.snapshot = self.snapshot, snap
        # repaint a pane only when its data changed: idle refreshes stay cheap
        if force or old is None or old.programs != snap.programs:
            self._main(ProgramsPane).show(snap.programs, snap.ts, self.needle)
        if force or old is None or _sidecar_rows(old) != _sidecar_rows(snap):
            self._main(SidecarsPane).show(snap.sidecars, snap.ts, self.needle)
        self._main(HostPane).show(snap.host)
        if force or old is None or old.device != snap.device:
            self._main(DevicePane).show(snap.device)
        if force or old is None or old.registration != snap.registration:
            self._show_registration()
        self._topbar()
        if self.watch_files:
            self._rearm_watch()

    def _show_registration(self) -> None:
        if self.snapshot:
            self._main(RegistrationPane).show(self.snapshot.registration, self.launch, self.status)

    def _watch_paths(self) -> tuple[str, ...]:
        from store.paths import state_dir

        candidates = (self.settings.kernel_cache_dir, self.settings.model_dir, state_dir())
        return tuple(str(p) for p in candidates if p.is_dir())

    def _rearm_watch(self) -> None:
        paths = self._watch_paths()
        if paths == self._watching:
            return
        self._watching = paths
        if self._watch_stop:
            self._watch_stop.set()
        if paths:
            self._watch_stop = asyncio.Event()
            self._watch(paths, self._watch_stop)

    @work(group="watch")
    async def _watch(self, paths: tuple[str, ...], stop: asyncio.Event) -> None:
        """Another process changed a cache, a sidecar or the history: refresh at once."""
        from watchfiles import awatch

        with contextlib.suppress(Exception):
            async for _ in awatch(*paths, stop_event=stop, debounce=400, recursive=True):
                self.refresh_now()

    # -- log ----------------------------------------------------------------------------------

    def log_line(self, source: str, text: str) -> None:
        self._main(LogPane).add(source, text)

    # -- read-only actions --------------------------------------------------------------------

    def action_refresh(self) -> None:
        self.refresh_now()

    def action_help(self) -> None:
        self.push_screen(HelpScreen([b for b in self.BINDINGS if isinstance(b, Binding)], MUTATING, self.readonly))

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        box.focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.needle = event.value.strip().lower()
        self._main(LogPane).filter(self.needle)
        if self.snapshot:
            self.apply_snapshot(self.snapshot, force=True)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.display = False
        self.set_focus(None)

    def on_key(self, event) -> None:
        box = self.query_one("#filter", Input)
        if event.key == "escape" and box.display:
            box.display = False
            self.set_focus(None)
            event.stop()

    def action_quit_console(self) -> None:
        if self.service and self.service.running:
            what = f"pid {self.service.pid}" + (f" serving {self.launch.url}" if self.launch and self.launch.url else "")

            def chosen(choice: str | None) -> None:
                if choice == LEAVE:
                    self.exit()
                elif choice == STOP:
                    self._stop_then_exit()

            self.push_screen(QuitScreen(what), chosen)
            return
        self.exit()

    @work(group="stop")
    async def _stop_then_exit(self) -> None:
        if self.service:
            await self.service.stop(self.stop_timeout)
        self.exit()

    # -- the one guard of every mutating action -----------------------------------------------

    def action_mutate(self, name: str) -> None:
        if name not in MUTATING:
            raise ValueError(f"unknown action {name}")
        if self.readonly:
            self.refused.append(name)
            self.notify(f"read-only: {name} refused", severity="warning")
            self.log_line("console", f"read-only: {name} refused")
            return
        getattr(self, f"_do_{name}")()

    def _busy(self, name: str) -> bool:
        job = self.jobs.get(name)
        if job and job.running:
            self.notify(f"{name} is already running (pid {job.pid})", severity="warning")
            return True
        return False

    def _model_ready(self) -> bool:
        if (self.settings.model_dir / sc.INDEX_NAME).is_file():
            return True
        self.notify(f"no checkpoint at {self.settings.model_dir}", severity="error")
        return False

    def _start(self, name: str, argv: list[str], *, detach: bool = False, label: str = "") -> Worker:
        w = Worker(name, argv, on_event=self._on_event, on_line=self._on_line, detach=detach)
        self.jobs[name] = w
        self.log_line("console", f"{name}: {' '.join(argv[2:])}")
        if label:
            self._main(SidecarsPane).job(label)
        return w

    def _on_line(self, worker: Worker, which: str, line: str) -> None:
        if not line.strip():
            return
        self.log_line(worker.name, line)
        m = _COMPILE_LINE.match(line)
        if m and worker.name == "warm":
            self._main(SidecarsPane).job(f"compile: {m.group(3)} {m.group(4)}", int(m.group(1)), int(m.group(2)))

    def _on_event(self, worker: Worker, event: Event) -> None:
        if event.kind == "error" and event.phase == worker.name:  # the parent's verdict on a dead worker
            self.failures.append(event)
            self.log_line("error", event.message or "failed")
            for line in event.detail.get("stderr", [])[-5:]:
                self.log_line("error", f"  {line}")
            self.notify(event.message or "failed", severity="error", timeout=8)
            self.status = f"[red]{event.message}[/]"
            if self.launch and worker is self.service:
                self.launch.apply(event)
            self._show_registration()
            return
        if worker is self.service and self.launch is not None:
            self.launch.apply(event)
            if event.kind in ("end", "error") or event.phase == "programs":
                self._show_registration()
            if event.kind == "log" and event.message:
                self.log_line(event.phase, event.message)
            if event.kind == "end" and event.phase == "serve":
                self._topbar()
            return
        if event.kind == "progress":
            what = event.detail.get("group") or event.detail.get("file") or ""
            self._main(SidecarsPane).job(f"{worker.name}: {fmt.size(event.done)} / {fmt.size(event.total)} {what}",
                                             event.done, event.total)
        elif event.message:
            self.log_line(worker.name, event.message)

    async def _finish(self, worker: Worker) -> int:
        self._topbar()
        code = await worker.run()
        self.log_line("console", f"{worker.name}: exit code {code}")
        if worker is not self.service:
            self._main(SidecarsPane).job("")
        self._topbar()
        self.refresh_now()
        return code

    def _do_create(self) -> None:
        if self._busy("create"):
            return
        self.log_line("console", f"creating the embedded default checkpoint ({default_preset()}) at "
                                 f"{self.settings.model_dir}")
        w = self._start("create", dsv4("check"),
                        label=f"creating the default {default_preset()} checkpoint (first run)…")
        self.run_worker(self._finish(w), group="jobs")

    def _do_prepack(self) -> None:
        if self._busy("prepack") or not self._model_ready():
            return
        argv = dsv4("prepack", str(self.settings.model_dir), "--ranks", str(self.settings.ranks),
                    "--events", "-")
        existing = sc.default_sidecar_path(self.settings.model_dir, self.settings.ranks)
        if not existing.exists():
            self.run_worker(self._finish(self._start("prepack", argv, label="prepack starting…")), group="jobs")
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                w = self._start("prepack", [*argv, "--force"], label="prepack starting…")
                self.run_worker(self._finish(w), group="jobs")

        self.push_screen(ConfirmScreen("Replace the sidecar?",
                                       f"{existing} ({fmt.size(existing.stat().st_size)}) exists; prepack "
                                       "writes a new one and replaces it in one rename."), confirmed)

    def _do_warm(self) -> None:
        if self._busy("warm") or not self._model_ready():
            return
        self.run_worker(self._warm(), group="jobs")

    async def _warm(self) -> None:
        s = self.settings
        path = sc.default_sidecar_path(s.model_dir, s.ranks)
        if path.is_file():
            code = await self._finish(self._start("warm", dsv4("sidecar", "warm", str(path), "--events", "-"),
                                                  label=f"warming {path.name}…"))
            if code != 0:
                return
        else:
            self.log_line("console", f"warm: no sidecar at {path}; prepack first (p). Compiling programs only")
        argv = dsv4("compile", str(s.model_dir), "--kernel-cache-dir", str(s.kernel_cache_dir),
                    "--device", s.device, "--backend", s.backend, "--max-seq", str(s.max_seq))
        await self._finish(self._start("warm", argv, label="compiling missing programs…"))

    def purge_selection(self) -> tuple[list[dict], list[dict]]:
        """What purge would delete, from the current snapshot: (program entries, sidecars)."""
        if not self.snapshot:
            return [], []
        entries = [e for e in self.snapshot.programs.entries
                   if e["state"] in PURGE_PROGRAM_STATES and not e.get("busy")]
        sidecars = [s for s in self.snapshot.sidecars.sidecars
                    if s["verdict"] == sc.REPACK and s["reason"] in PURGE_SIDECAR_REASONS and Path(s["path"]).is_file()]
        return entries, sidecars

    def _do_purge(self) -> None:
        entries, sidecars = self.purge_selection()
        if not entries and not sidecars:
            self.notify("nothing to purge: no stale or corrupt entries, no stale sidecars")
            return
        nbytes = sum(e["size_bytes"] for e in entries) + sum(s["size_bytes"] for s in sidecars)
        lines = [f"{len(entries)} program entries and {len(sidecars)} sidecars, {fmt.size(nbytes)}:"]
        lines += [f"  {e['program']}/{e['fingerprint'][:12]} {e['state']} {fmt.size(e['size_bytes'])}" for e in entries[:12]]
        lines += [f"  {s['path']} {s['reason']} {fmt.size(s['size_bytes'])}" for s in sidecars]
        if len(entries) > 12:
            lines.append(f"  … and {len(entries) - 12} more entries")

        def confirmed(yes: bool | None) -> None:
            if yes:
                self._purge(entries, sidecars)
            else:
                self.log_line("console", "purge: cancelled, nothing deleted")

        self.push_screen(ConfirmScreen("Delete these?", "\n".join(lines)), confirmed)

    @work(thread=True, group="purge")
    def _purge(self, entries: list[dict], sidecars: list[dict]) -> None:
        from store import kernel_cache as kc

        cache = kc.KernelCache(self.settings.kernel_cache_dir)
        chosen = {(e["program"], e["fingerprint"]) for e in entries}
        # delete exactly what was confirmed, if it is still there (and still not current)
        now = [e for e in cache.inventory(self.collectors.reference() if hasattr(self.collectors, "reference") else None)
               if (e.program, e.fingerprint) in chosen and e.state in PURGE_PROGRAM_STATES and not e.busy]
        removed = cache.remove(now)
        gone = 0
        for s in sidecars:
            with contextlib.suppress(FileNotFoundError):
                Path(s["path"]).unlink()
                gone += 1
        self.call_from_thread(self.log_line, "console",
                              f"purge: deleted {len(removed)} program entries and {gone} sidecars")
        self.call_from_thread(self.refresh_now)

    def _do_launch(self) -> None:
        if self.service and self.service.running:
            self.notify(f"a service is already running (pid {self.service.pid}); stop it first (s)", severity="warning")
            return
        if not self._model_ready():
            return
        s = self.settings
        argv = dsv4("serve", str(s.model_dir), "--events", "-", "--port", "0",
                    "--kernel-cache-dir", str(s.kernel_cache_dir), "--device", s.device,
                    "--memory-utilization", str(s.memory_utilization), "--backend", s.backend,
                    "--max-seq", str(s.max_seq), "--ranks", str(s.ranks))
        self.launch = LaunchState()
        self.status = ""
        self.service = self._start("launch", argv, detach=True)
        self._show_registration()
        self.run_worker(self._finish(self.service), group="jobs")

    def _do_stop(self) -> None:
        if not (self.service and self.service.running):
            self.notify("no service started here is running")
            return
        self.log_line("console", f"stop: SIGTERM to pid {self.service.pid}")
        self.run_worker(self._stop(), group="stop")

    async def _stop(self) -> None:
        if self.service:
            code = await self.service.stop(self.stop_timeout)
            self.status = f"service stopped (exit code {code})"
            self.log_line("console", self.status)
            self._show_registration()
            self._topbar()


def _sidecar_rows(snap: Snapshot) -> list[dict[str, Any]]:
    """The sidecar rows without their sampling time (which changes on every refresh)."""
    return [{k: v for k, v in row.items() if k != "sampled_at"} for row in snap.sidecars.sidecars] + [
        {"error": snap.sidecars.error}]


# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4-console", description="Operations console for DeepSeek V4 serving "
                                "hosts: program cache, weight sidecars, host, device, registration.")
    p.add_argument("--model", type=Path, metavar="DIR",
                   help="checkpoint dir (default: the embedded synthetic checkpoint, made on first run)")
    p.add_argument("--kernel-cache-dir", type=Path, metavar="DIR", help="program cache root")
    p.add_argument("--device", choices=("auto", "cpu", "cuda", "npu"), default="auto")
    p.add_argument("--memory-utilization", type=float, default=0.9, metavar="F",
                   help="fraction of device memory a launch may use (KV budget)")
    p.add_argument("--backend", choices=("auto", "aoti", "export", "eager"), default="auto",
                   help="program backend for launch and warm")
    p.add_argument("--max-seq", type=int, default=1024, help="context length per KV slot for launch")
    p.add_argument("--ranks", type=int, default=1, help="expert-parallel ranks of the sidecar")
    p.add_argument("--interval", type=float, default=2.0, metavar="SECONDS", help="refresh period (default 2)")
    p.add_argument("--readonly", action="store_true", help="refuse every mutating action")
    p.add_argument("--once", action="store_true", help="collect once, print, exit")
    p.add_argument("--json", action="store_true", help="with --once: print every pane's data as JSON")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings.make(args.model, args.kernel_cache_dir, device=args.device,
                         memory_utilization=args.memory_utilization, backend=args.backend,
                         ranks=args.ranks, max_seq=args.max_seq)


def once(settings: Settings, as_json: bool = True) -> dict[str, Any]:
    collectors = Collectors(settings)
    time.sleep(0.25)  # host rates need two samples
    data = collectors.snapshot().to_json()
    if as_json:
        json.dump(data, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    return data


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.memory_utilization <= 1:
        print("dsv4-console: --memory-utilization must be within (0, 1]", file=sys.stderr)
        return 2
    if args.interval < 0.1:
        print("dsv4-console: --interval must be at least 0.1 s", file=sys.stderr)
        return 2
    settings = settings_from(args)
    if args.once:
        once(settings)
        return 0
    app = Dsv4Console(settings, readonly=args.readonly, interval=args.interval)
    app.run()
    if app.service and app.service.running:
        print(f"dsv4-console: left the service running (pid {app.service.pid})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())


class _Absent:
    """Swallows any call: stands in for a pane that is not mounted."""

    def __getattr__(self, _name: str):
        return lambda *args, **kwargs: None


_ABSENT = _Absent()
