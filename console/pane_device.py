"""Device pane: used / free / total per device and the KV budget, with the starvation warning."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Static

from console import fmt
from console.collectors import DeviceSnapshot
from console.pane import Pane


class DevicePane(Pane):
    def compose(self) -> ComposeResult:
        yield Static(id="device-text")

    def on_mount(self) -> None:
        self.border_title = "Device"

    def show(self, snap: DeviceSnapshot) -> None:
        lines = []  # the KV budget first: it is the one line a collapsed pane keeps
        for d in snap.devices:
            slots = f" ({d['slots']} KV slots of {fmt.size(snap.slot_bytes)})" if d["slots"] is not None else ""
            warn = f"  [b red]⚠ {d['warning']}[/]" if d["warning"] else ""
            lines.append(f"KV budget [b]{fmt.size(max(d['budget'], 0))}[/]{slots}{warn}")
        if snap.error:
            lines.insert(0, f"[red]{snap.error}[/]")
        lines.append(f"[dim]{snap.kind} via {snap.source}, utilization {snap.utilization}[/]")
        for d in snap.devices:
            used = d["used"] / d["total"] if d["total"] else 0.0
            lines.append(f"[b]{d['name']}[/]  {fmt.bar(used, 16)} used")
            lines.append(f"  used {fmt.size(d['used'])}  free {fmt.size(d['free'])}  total {fmt.size(d['total'])}")
        self.query_one("#device-text", Static).update("\n".join(lines))
