"""Device pane: used / free / total per device and the KV budget, with the starvation warning."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from console import fmt
from console.collectors import DeviceSnapshot


class DevicePane(Vertical):
    def compose(self) -> ComposeResult:
        yield Static(id="device-text")

    def on_mount(self) -> None:
        self.border_title = "Device"

    def show(self, snap: DeviceSnapshot) -> None:
        lines = [f"[dim]{snap.kind} via {snap.source}, utilization {snap.utilization}[/]"]
        if snap.error:
            lines.append(f"[red]{snap.error}[/]")
        for d in snap.devices:
            used = d["used"] / d["total"] if d["total"] else 0.0
            lines.append(f"[b]{d['name']}[/]  {fmt.bar(used, 16)} used")
            lines.append(f"  used {fmt.size(d['used'])}  free {fmt.size(d['free'])}  total {fmt.size(d['total'])}")
            slots = f"  ({d['slots']} KV slots of {fmt.size(snap.slot_bytes)})" if d["slots"] is not None else ""
            lines.append(f"  KV budget {fmt.size(max(d['budget'], 0))}{slots}")
            if d["warning"]:
                lines.append(f"  [b red]⚠ {d['warning']}[/]")
        self.query_one("#device-text", Static).update("\n".join(lines))
