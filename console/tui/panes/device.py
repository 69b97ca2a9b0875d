"""Device pane: used / free / total per device and each rank's KV budget (the plan's rule,
`runtime.launch.budget`): what the memory fits and what the launch takes (--max-slots caps
it), with the starvation warning, and the service's slots (each rank holds its own sequences:
the sum); on cpu the ranks share host memory (or each has --device-memory), on accelerators
rank r owns device r. Then each serving rank's device as the service reads it (utilisation,
memory, temperature, power from NVML or npu-smi), `n/a` on the CPU."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.widgets import Static

from console import fmt
from console.data.host import DeviceSnapshot
from console.data.services import ServicesSnapshot
from console.tui.panes.base import Pane
from runtime.contract import DeviceUse
from runtime.launch.plan_report import RankKv

NA = "n/a"


def slots_text(b: RankKv, each: str = "") -> str:
    """`fits 3994 slots · launch takes 32 (--max-slots)`, or just the slots it takes."""
    if b.fits > b.slots:
        return f"{each}fits {b.fits} slots · launch takes {b.slots} (--max-slots)"
    return f"{each}{b.slots} slots"


def kv_lines(snap: DeviceSnapshot) -> list[str]:
    """One line per rank's budget (one line for ranks that share host memory): what fits, what
    the launch takes, and a warning when the launch would fail at kv."""
    if not snap.budgets:
        return [] if snap.slot_bytes else ["[dim]KV budget: no slot size yet (the plan has none)[/]"]
    lines = []
    shared = snap.kind == "cpu" and snap.ranks > 1
    for b in snap.budgets[:1] if shared else snap.budgets:
        warn = f"  [b red]⚠ {b.problem}: the launch would fail at kv[/]" if b.problem else ""
        budget = f"KV budget [b]{fmt.size(max(b.budget, 0))}[/]"
        if shared:
            lines.append(f"{budget} × {snap.ranks} ranks · {slots_text(b, 'each ')} · {snap.slots} in all{warn}")
        elif snap.ranks > 1:
            lines.append(f"rank {b.rank} on {b.device.split()[0]}  {budget} · {slots_text(b)}{warn}")
        else:
            lines.append(f"{budget} · {slots_text(b)}{warn}")
    if snap.ranks > 1 and not shared:
        lines.append(f"{len(snap.budgets)} ranks · {snap.slots} slots in all (each rank holds its own sequences)")
    return lines


def use_text(use: DeviceUse | None) -> str:
    """`util 87% · mem 61.0 GiB / 80.0 GiB · 64 °C · 312 W` as the device's tool read it, `n/a`
    for what it did not say; a CPU rank (no accelerator to ask): `util, temp, power n/a`."""
    if use is None:
        return f"util, temp, power {NA} (no accelerator)"
    util = NA if use.utilization is None else f"{use.utilization:.0f}%"
    mem = NA if use.memory_used is None else fmt.size(use.memory_used) + (
        f" / {fmt.size(use.memory_total)}" if use.memory_total else "")
    temp = f"temp {NA}" if use.temperature is None else f"{use.temperature:.0f} °C"
    power = f"power {NA}" if use.power is None else f"{use.power:.0f} W"
    return f"util {util} · mem {mem} · {temp} · {power}"


def use_lines(services: ServicesSnapshot | None) -> list[str]:
    """Each live service's ranks on their devices, as the service reads them (/health's
    `device_use`: NVML, npu-smi): one line per rank, `n/a` on a CPU rank."""
    lines = []
    for view in services.services if services else ():
        for r in view.ranks if not view.ended else ():
            device = r.device_use.name if r.device_use else r.device or "cpu"
            lines.append(f"pid {view.pid} rank {r.rank} {device}: {use_text(r.device_use)}")
    return lines


class DevicePane(Pane):
    def compose(self) -> ComposeResult:
        yield Static(id="device-text")

    def on_mount(self) -> None:
        self.border_title = "Device"

    def show(self, snap: DeviceSnapshot, services: ServicesSnapshot | None = None) -> None:
        lines = kv_lines(snap)  # first: a collapsed pane keeps it
        if snap.warning:
            lines.insert(0, f"[b red]⚠ {snap.warning}[/]")
        if snap.error:
            lines.insert(0, f"[red]{snap.error}[/]")
        slot = f", one KV slot {fmt.size(snap.slot_bytes)}" if snap.slot_bytes else ""
        lines.append(f"[dim]{snap.kind} via {snap.source}, --memory-utilization {snap.utilization}{slot}[/]")
        owned = {b.device for b in snap.budgets}
        for d in snap.devices:
            idle = "" if snap.kind == "cpu" or d.name in owned else "  [dim]no rank[/]"
            lines.append(f"[b]{d.name}[/]  {fmt.bar(d.fraction, 16)} used{idle}")
            lines.append(f"  used {fmt.size(d.used)}  free {fmt.size(d.free)}  total {fmt.size(d.total)}")
        lines += use_lines(services)
        self.query_one("#device-text", Static).update("\n".join(lines))
