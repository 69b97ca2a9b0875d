"""Device pane: used / free / total per device and the KV budget, with the starvation warning;
with several ranks, whose budget each line is (per rank on cpu, one rank per device otherwise)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.widgets import Static

from console import fmt
from console.collectors import DeviceSnapshot
from console.pane import Pane


def kv_line(snap: DeviceSnapshot, index: int, d: dict[str, Any]) -> str:
    """`KV budget 6.0 GiB (6144 KV slots of 1.0 MiB)`; `… per rank × 2 ranks (N KV slots each)`
    when ranks share host memory; `rank 1 on cuda:1  KV budget …` when each rank has a device."""
    warn = f"  [b red]⚠ {d['warning']}[/]" if d["warning"] else ""
    sharing = d.get("ranks", 1)
    budget = f"KV budget [b]{fmt.size(max(d.get('rank_budget', d['budget']), 0))}[/]"
    if sharing > 1:
        slots = f" ({d['slots']} KV slots each)" if d["slots"] is not None else ""
        return f"{budget} per rank × {sharing} ranks{slots}{warn}"
    slots = f" ({d['slots']} KV slots of {fmt.size(snap.slot_bytes)})" if d["slots"] is not None else ""
    if snap.ranks > 1:
        device = d["name"].split()[0]
        return f"rank {index} on {device}  {budget}{slots}{warn}" if sharing else f"[dim]{device}: no rank[/]"
    return f"{budget}{slots}{warn}"


class DevicePane(Pane):
    def compose(self) -> ComposeResult:
        yield Static(id="device-text")

    def on_mount(self) -> None:
        self.border_title = "Device"

    def show(self, snap: DeviceSnapshot) -> None:
        lines = [kv_line(snap, i, d) for i, d in enumerate(snap.devices)]  # first: a collapsed pane keeps it
        if snap.warning:
            lines.insert(0, f"[b red]⚠ {snap.warning}[/]")
        if snap.error:
            lines.insert(0, f"[red]{snap.error}[/]")
        lines.append(f"[dim]{snap.kind} via {snap.source}, utilization {snap.utilization}[/]")
        for d in snap.devices:
            used = d["used"] / d["total"] if d["total"] else 0.0
            lines.append(f"[b]{d['name']}[/]  {fmt.bar(used, 16)} used")
            lines.append(f"  used {fmt.size(d['used'])}  free {fmt.size(d['free'])}  total {fmt.size(d['total'])}")
        self.query_one("#device-text", Static).update("\n".join(lines))
