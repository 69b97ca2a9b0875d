"""Live per-phase progress for `dsv4 serve` in a terminal (rich, on stderr)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn


class PhaseDisplay:
    def __init__(self) -> None:
        self.console = Console(stderr=True)
        self.progress = Progress(TextColumn("{task.description:<9}"), BarColumn(), TaskProgressColumn(),
                                 TimeElapsedColumn(), TextColumn("[dim]{task.fields[note]}"),
                                 console=self.console)
        self.tasks: dict[str, int] = {}
        self.progress.start()

    def sink(self, event) -> None:
        phase = event.phase
        if phase not in self.tasks:
            self.tasks[phase] = self.progress.add_task(phase, total=None, note="")
        task = self.tasks[phase]
        if event.kind == "progress" and event.total:
            note = event.detail.get("program") or event.detail.get("group") or event.detail.get("part") or ""
            if "outcome" in event.detail:
                note = f"{note} {event.detail['outcome']}"
            self.progress.update(task, completed=event.done, total=event.total, note=note)
        elif event.kind == "end":
            d = event.detail
            note = d.get("path", "") + (f" ({d['reason']})" if d.get("reason") else "")
            if "counts" in d:
                note = " ".join(f"{k} {v}" for k, v in d["counts"].items() if v)
            if "slots" in d:
                note = f"{d['slots']} slots"
            self.progress.update(task, completed=1, total=1, note=f"{event.seconds:.2f} s {note}")
        elif event.kind == "error":
            self.progress.update(task, note=f"[red]{event.message}")
        elif event.kind == "log" and event.message:
            self.progress.console.print(f"[dim]{phase}: {event.message}")

    def stop(self) -> None:
        self.progress.stop()
