"""Host pane: CPU (total and per core), load, memory and page cache, disk rates, sparklines."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Sparkline, Static

from console.tui import fmt
from console.tui.data.collectors import HostSnapshot
from console.tui.panes.base import Pane


class HostPane(Pane):
    def compose(self) -> ComposeResult:
        yield Static(id="host-text")
        yield Static("cpu", classes="spark-label")
        yield Sparkline([], id="spark-cpu")
        yield Static("disk read / write", classes="spark-label")
        yield Sparkline([], id="spark-read")
        yield Sparkline([], id="spark-write")

    def on_mount(self) -> None:
        self.border_title = "Host"

    def show(self, snap: HostSnapshot) -> None:
        cores = " ".join(f"{c:3.0f}" for c in snap.per_core)
        load = " ".join(f"{x:.2f}" for x in snap.load)
        self.query_one("#host-text", Static).update(
            f"CPU [b]{snap.cpu_percent:5.1f}%[/]  cores {cores}\n"
            f"load {load}\n"
            f"mem available {fmt.size(snap.mem_available)} / {fmt.size(snap.mem_total)}  "
            f"page cache {fmt.size(snap.page_cache)}\n"
            f"disk read {fmt.rate(snap.disk_read_bps)}  write {fmt.rate(snap.disk_write_bps)}")
        for key, wid in (("cpu", "#spark-cpu"), ("read", "#spark-read"), ("write", "#spark-write")):
            self.query_one(wid, Sparkline).data = list(snap.history.get(key, ()))
