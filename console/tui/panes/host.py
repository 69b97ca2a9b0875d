"""Host pane: CPU (total and per core, each labelled), load, memory and page cache, disk rates,
sparklines with their scale: CPU's drawn from 0 to 100 % (a flat line at 100 % is full), the disk
rates' from their lowest to their highest bar, whose values the labels say."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Sparkline, Static

from console import fmt
from console.data.host import HostSnapshot
from console.tui.panes.base import Pane

LABELLED_CORES = 16  # more than this (a serving host has 100+): the busiest core and how many are busy


def cores_line(per_core: tuple[float, ...]) -> str:
    """`cores c0 20% c1 27%`, or on a big host `192 cores: busiest c12 98% · median 20% · 3 at 90%+`."""
    if not per_core:
        return ""
    if len(per_core) <= LABELLED_CORES:
        return "cores " + " ".join(f"c{i} {c:.0f}%" for i, c in enumerate(per_core))
    busiest = max(range(len(per_core)), key=per_core.__getitem__)
    median = sorted(per_core)[len(per_core) // 2]
    busy = sum(c >= 90 for c in per_core)
    return (f"{len(per_core)} cores: busiest c{busiest} {per_core[busiest]:.0f}% · median {median:.0f}% · "
            f"{busy} at 90%+")


def scale(values: tuple[float, ...], unit: str, per: float = 1.0, digits: int = 0) -> str:
    """A sparkline's scale, `5–90%`: the values of its lowest and highest bar."""
    return f"{min(values) / per:.{digits}f}–{max(values) / per:.{digits}f}{unit}" if values else "-"


class HostPane(Pane):
    def compose(self) -> ComposeResult:
        yield Static(id="host-text")
        yield Static("cpu", id="spark-cpu-label", classes="spark-label")
        yield Static("", id="spark-cpu", classes="spark-bars")
        yield Static("disk read / write", id="spark-disk-label", classes="spark-label")
        yield Sparkline([], id="spark-read")
        yield Sparkline([], id="spark-write")

    def on_mount(self) -> None:
        self.border_title = "Host"
        self.cpu: tuple[float, ...] = ()

    def on_resize(self) -> None:
        self.draw_cpu()

    def draw_cpu(self) -> None:
        bars = self.query_one("#spark-cpu", Static)
        bars.update(fmt.bars(self.cpu, bars.size.width or 40, top=100.0))

    def show(self, snap: HostSnapshot) -> None:
        load = " ".join(f"{x:.2f}" for x in snap.load)
        self.query_one("#host-text", Static).update(
            f"CPU [b]{snap.cpu_percent:5.1f}%[/]  {cores_line(snap.per_core)}\n"
            f"load {load}\n"
            f"mem available {fmt.size(snap.mem_available)} / {fmt.size(snap.mem_total)}  "
            f"page cache {fmt.size(snap.page_cache)}\n"
            f"disk read {fmt.rate(snap.disk_read_bps)}  write {fmt.rate(snap.disk_write_bps)}")
        history = {k: tuple(snap.history.get(k, ())) for k in ("cpu", "read", "write")}
        self.cpu = history["cpu"]
        self.draw_cpu()
        for key, wid in (("read", "#spark-read"), ("write", "#spark-write")):
            self.query_one(wid, Sparkline).data = list(history[key])
        points = f"[dim]last {len(history['cpu'])} samples[/]" if history["cpu"] else ""
        self.query_one("#spark-cpu-label", Static).update(
            f"cpu {scale(history['cpu'], '%')}  {points}" + ("[dim], bars 0–100%[/]" if points else ""))
        self.query_one("#spark-disk-label", Static).update(
            f"disk read {scale(history['read'], ' MB/s', 1e6, 1)} / write {scale(history['write'], ' MB/s', 1e6, 1)}")
