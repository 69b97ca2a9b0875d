"""A fleet's rows: one per host, from its snapshot and what the other hosts' snapshots say of it
(the service's ranks that run there, as rank 0's /health reports them; the toolchain components
where it differs from the rest)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any

from console import fmt
from console.data.nodes import NodeRank, NodeView
from console.data.services import ServiceView
from console.data.snapshot import Snapshot
from console.data.toolchain import ORDER
from console.fleet.host import HostReading
from runtime.events import REGISTRATION
from runtime.programs.outcome import Outcome

SHORT = 28  # a toolchain value in a drift line


def _short(value: str) -> str:
    return value if len(value) <= SHORT else value[: SHORT - 1] + "…"


def drift(readings) -> dict[str, tuple[str, ...]]:
    """host → each toolchain component where it differs from what most hosts have, in words:
    `torch 2.12.1 here, 2.13.0 on 3 others`. Hosts without a snapshot take no part."""
    tools = {r.host: r.snapshot.toolchain for r in readings if r.snapshot is not None and r.snapshot.toolchain}
    out: dict[str, tuple[str, ...]] = {}
    if len(tools) < 2:
        return out
    keys = [k for k in ORDER if any(k in t for t in tools.values())]
    keys += sorted({k for t in tools.values() for k in t} - set(keys) - {"error"})
    for host, mine in tools.items():
        lines = []
        for key in keys:
            counts = Counter(t.get(key, "-") for t in tools.values())
            common, n = counts.most_common(1)[0]
            here = mine.get(key, "-")
            if here == common and n > len(tools) / 2:
                continue
            if key == "torch.git" and mine.get("torch") != common and "torch" in mine:
                continue  # another torch says it already
            others = Counter(t.get(key, "-") for h, t in tools.items() if h != host and t.get(key, "-") != here)
            if not others:
                continue
            elsewhere = ", ".join(f"{_short(v)} on {c} other{'s' if c > 1 else ''}" for v, c in others.most_common(2))
            lines.append(f"{key} {_short(here)} here, {elsewhere}")
        if lines:
            out[host] = tuple(lines)
    return out


def service_of(snap: Snapshot) -> ServiceView | None:
    """The service this host serves: a live one first, else the one that ended last."""
    views = snap.services.services
    live = [v for v in views if not v.ended]
    if live:
        return live[0]
    ended = [v for v in views if v.record.ending is not None]
    return max(ended, key=lambda v: v.record.ending.at) if ended else None


def _programs(snap: Snapshot) -> str:
    counts = Counter(e.state for e in snap.programs.entries)
    return " ".join(f"{s.value} {counts[s]}" for s in Outcome if counts[s]) \
        or ("-" if not snap.programs.problem else "?")


def _sidecar(snap: Snapshot) -> str:
    side = snap.sidecars.wanted
    if side is None:
        return "-"
    return f"{side.verdict} {side.residency:.0%}" if side.residency is not None else side.verdict


def _coarse(n: float) -> str:
    """A count to two significant figures (63536 → 64k): a row that says the same between
    refreshes is not repainted, and the third digit of what fits is noise."""
    if n < 1000:
        return f"{n:.0f}"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{float(f'{n / div:.2g}'):g}{unit}"
    return f"{n:.0f}"


def _coarse_size(n: float | None) -> str:
    """A size in whole GiB from 10 GiB on (free memory and disk move by megabytes every second)."""
    if n is None:
        return "?"
    return f"{n / 2**30:.0f} GiB" if n >= 10 * 2**30 else fmt.size(n)


def _device(snap: Snapshot) -> str:
    """`23.5 GiB 4% · KV 128/64k`: memory and how much is used, the slots this host's ranks take
    and what fits (the plan sized them for the ranks on this host's own devices)."""
    d = snap.device
    if d.error:
        return d.error
    total = sum(x.total for x in d.devices)
    used = sum(x.used for x in d.devices)
    kv = f" · KV {d.slots}/{_coarse(d.fits)}" if d.slots is not None and d.fits is not None else ""
    return f"{fmt.size(total)} {used / total:.0%}{kv}" if total else f"-{kv}"


def _room(snap: Snapshot) -> tuple[str, bool]:
    """Free disk where the sidecar is written, and page-cache room for it (memory available
    against its size): `40 GiB · 18 GiB`, and False when either is short."""
    side = snap.sidecars.wanted
    need = (side.expected_bytes or side.size_bytes or 0) if side else 0
    disk = snap.sidecars.disk_free
    room = snap.host.mem_available
    short = bool(need) and ((disk is not None and not side.mapped and disk < need) or room < need)
    return f"{_coarse_size(disk)} · {_coarse_size(room)}", not short


def _ranks_here(readings, hostname: str) -> list:
    """The ranks of any fleet service that run on `hostname`, as their rank 0 reports them."""
    out = []
    for r in readings:
        if r.snapshot is None:
            continue
        for v in r.snapshot.services.services:
            if not v.ended:
                out += [rank for rank in v.ranks if rank.host == hostname]
    return out


def _node(snap: Snapshot) -> NodeView | None:
    return snap.nodes[0] if snap.nodes else None


def registering(snap: Snapshot) -> list[NodeRank]:
    """The ranks of this host's running node still in registration (phase before serve)."""
    node = _node(snap)
    return node.registering() if node else []


def slowest(readings) -> str:
    """While a service registers across hosts: the host furthest behind, and where it is."""
    behind = []
    for r in readings:
        for rank in registering(r.snapshot) if r.snapshot is not None else ():
            behind.append((REGISTRATION.index(rank.phase), rank.fraction, r.host, rank))
    if len({b[2] for b in behind}) < 2:
        return ""
    _, _, host, rank = min(behind, key=lambda b: (b[0], b[1]))
    step = f" {rank.done:g}/{rank.total:g}" if rank.total is not None and rank.done else ""
    return f"slowest: {host} ({rank.phase}{step})"


def _phases(snap: Snapshot, ranks: list, now: float) -> str:
    """Each rank here: its phase as rank 0's /health reports it, else (while it registers, before
    /health knows it) as its own events say, with n/total and ETA; and the oldest heartbeat."""
    live = {x.rank: x for x in ranks}
    node = _node(snap)
    parts = []
    for r in node.ranks if node and node.running else ():
        if r.rank in live and live[r.rank].phase:
            continue
        step = f" {r.done:g}/{r.total:g}" if r.done is not None and r.total is not None else ""
        eta = r.eta() if r.state == "running" else None
        step += f" ETA {fmt.duration(eta)}" if eta is not None else ""
        parts.append(f"r{r.rank} {r.phase or '?'}{step}{'✗' if r.state == 'error' else ''}")
    parts += [f"r{x.rank} {x.phase or '-'}" + (" ✗" if x.error else "") for x in ranks]
    beats = [x.heartbeat_age for x in ranks if x.heartbeat_age is not None]
    if beats:
        parts.append(f"beat {max(beats):.1f} s")
    return " ".join(parts) or "-"


def _service_state(snap: Snapshot, view: ServiceView | None) -> str:
    """The service here, or (none running) what blocks a launch here, in its own words."""
    node = _node(snap)
    if view is not None and not view.ended:
        reason = view.detail.reason if view.detail is not None and not view.detail.ok else ""
        return f"{view.state}: {reason}" if reason else view.state
    if node is not None and node.running:
        return f"node {node.state}"
    if (problem := snap.blocking()) is not None:
        return f"blocked: {problem.line()}"
    if view is not None:
        return f"ended: {view.ending_line()}"
    return f"node {node.state}" if node is not None else "-"


@dataclass(frozen=True, kw_only=True)
class HostRow:
    """One host's row of the fleet screen: what each column says, and the reading under it."""

    host: str
    node: int
    reading: HostReading = field(compare=False)
    reach: str = "✗"  # ✓ | stale | ✗
    state: str = ""  # the service here, what blocks a launch, or why the host is not reachable
    ok: bool = False
    left_out: bool = False
    drift: tuple[str, ...] = ()
    version: str = ""
    toolchain: str = ""
    programs: str = ""
    sidecar: str = ""
    device: str = ""  # memory, and this host's KV slots / what fits
    device_ok: bool = True
    room: str = ""
    roomy: bool = True
    phases: str = ""
    tokens_s: float | None = None
    age: float | None = None
    hostname: str = ""
    service: ServiceView | None = field(default=None, compare=False)
    slots: int | None = None  # this host's KV slots (its own ranks')
    fits: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("reading", "service")}
        out["drift"] = list(self.drift)
        return out


def rows(fleet_snapshot, now: float | None = None) -> list[HostRow]:
    """One row per host; an unreachable host keeps what was last known of it, marked with its age."""
    now = now or time.time()
    readings = fleet_snapshot.hosts
    left_out = set(fleet_snapshot.left_out)
    drifts = drift(readings)
    out = []
    for r in readings:
        base = {"host": r.host, "node": r.node_rank, "reading": r, "drift": drifts.get(r.host, ()),
                "left_out": r.host in left_out, "age": r.age_s}
        if r.snapshot is None:
            out.append(HostRow(**base, state=r.error or "unreachable"))
            continue
        try:
            row = HostRow(**base, **_figures(r, readings, drifts, now))
        except (AttributeError, TypeError, KeyError, ValueError) as e:  # a snapshot that parsed but says nonsense
            row = HostRow(**base, state=f"unreadable snapshot ({type(e).__name__}: {e})"[:200])
        out.append(row)
    return out


def _figures(r: HostReading, readings, drifts: dict[str, tuple[str, ...]], now: float) -> dict[str, Any]:
    """The columns of a host with a snapshot (its last known one, when it is away now)."""
    snap = r.snapshot
    view = service_of(snap)
    room, roomy = _room(snap)
    reach = "✓" if r.fresh else "stale" if r.reachable else "✗"
    state = _service_state(snap, view)
    if r.error:  # why it is not fresh first, then what was last known
        known = f"last known {fmt.duration(r.age_s)} ago: " if r.age_s is not None else "last known: "
        state = f"{r.error} — {known}{state}"
    return {"reach": reach, "ok": r.fresh and not r.error and not state.startswith(("blocked", "failed", "ended")),
            "version": snap.toolchain.get("dsv4", "?"), "device_ok": not snap.device.error,
            "toolchain": "; ".join(drifts.get(r.host, ())) or "same", "programs": _programs(snap),
            "sidecar": _sidecar(snap), "device": _device(snap), "room": room, "roomy": roomy, "state": state,
            "phases": _phases(snap, _ranks_here(readings, snap.hostname), now),
            "tokens_s": view.serving.tokens_s if view and view.serving else None,
            "hostname": snap.hostname, "service": view, "slots": snap.device.slots, "fits": snap.device.fits}


def kv_total(fleet_rows: list[HostRow]) -> tuple[int, int] | None:
    """The service's KV: every host's slots and what fits, summed (None: no host knows yet)."""
    known = [r for r in fleet_rows if not r.left_out and r.slots is not None]
    if not known:
        return None
    return sum(r.slots or 0 for r in known), sum(r.fits or 0 for r in known)
