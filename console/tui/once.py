"""`dsv4-console --once`: every pane's data once, as text for a person (or JSON with `--json`),
from the same snapshot the screen renders."""

from __future__ import annotations

from pathlib import Path

from rich.text import Text

from console import fmt
from console.data.snapshot import Snapshot
from console.tui.panes.device import kv_lines, use_lines
from console.tui.panes.services import rank_line, ranks_worth_a_line, serving_lines
from runtime.events import PHASES


def _plain(markup: str) -> str:
    return Text.from_markup(markup).plain


def render(snap: Snapshot) -> str:
    s = snap.settings
    lines = [f"dsv4-console  model {s.model}  device {s.device}  backend {s.backend}  "
             f"ranks {s.ranks}  max-seq {s.max_seq}"]
    programs = snap.programs
    states = ", ".join(f"{n} {state}" for state, n in programs.by_state().items()) or "none"
    lines += ["", f"Programs (next launch): {states}"]
    lines += [f"  {e.program:<30} {e.state:<10} {e.reason}".rstrip() for e in programs.entries]
    if programs.problem:
        lines.append(f"  problem: {programs.problem.line()}")
    cache = snap.cache
    kinds = ", ".join(f"{state} {n}" for state, n in cache.by_state().items())
    lines += ["", f"Kernel cache {cache.root}: {len(cache.entries)} entries, {fmt.size(cache.total_bytes)} of "
                  f"{fmt.size(cache.limit_bytes)} gc limit" + (f" ({kinds})" if kinds else "")
              + (f"; {cache.error}" if cache.error else "")]
    lines += ["", "Sidecars:"]
    if (w := snap.sidecars.wanted) is not None:
        residency = "-" if w.residency is None else f"{w.residency:.0%} resident"
        lines.append(f"  {Path(w.path).name:<30} {w.next_launch():<22} {residency}  {w.detail}".rstrip())
    for o in snap.sidecars.others:
        lines.append(f"  {Path(o.path).name:<30} {'not used (ranks ' + str(o.ranks or '?') + ')':<22} -")
    if snap.sidecars.error:
        lines.append(f"  {snap.sidecars.error}")
    lines += ["", "Services:" if snap.services.services else "Services: none running on this host"]
    for v in snap.services.services:
        lines.append(f"  pid {v.pid}  {v.url or '-'}  {v.state}  {v.model}  backend {v.backend or '-'}  "
                     f"max-seq {v.max_seq or '-'}  ranks {v.rank_count}")
        if v.ended:
            lines.append(f"    {v.ending_line()}")
        if s_ := v.serving:
            lines += [f"    {_plain(line)}" for line in serving_lines(s_)]
        if ranks_worth_a_line(v):
            lines.append(f"    {_plain(rank_line(v))}")
    h = snap.host
    lines += ["", f"Host: CPU {h.cpu_percent:.1f}%  load {' '.join(map(str, h.load))}  memory available "
                  f"{fmt.size(h.mem_available)} of {fmt.size(h.mem_total)}  page cache {fmt.size(h.page_cache)}"]
    d = snap.device
    lines += ["", f"Device ({d.kind} via {d.source}):"]
    if d.error:
        lines.append(f"  {d.error}")
    lines += [f"  {_plain(line)}" for line in kv_lines(d) + use_lines(snap.services)]
    reg = snap.registration
    lines += ["", f"Registration, next launch ({reg.basis}):" if reg.basis else "Registration, next launch:"]
    for phase in PHASES:
        seconds = reg.predicted.get(phase)
        lines.append(f"  {phase:<9} {fmt.secs(seconds):>8}  {reg.prediction.get(phase, '')}")
    return "\n".join(lines)


def fleet_text(snap, spec, kv: tuple[int, int] | None = None) -> str:
    """A fleet's status for a person: the service's settings and KV over its hosts, then each
    host (reachable or why not, its toolchain against the others', and its panes' data)."""
    from console.fleet.rows import drift

    hosts = [r for r in snap.hosts if r.host not in snap.left_out]
    head = (f"fleet: {len(hosts)} hosts  model {spec.model or '-'}  backend {spec.backend}  ranks {spec.ranks}  "
            f"max-seq {spec.max_seq}") + (f"  KV {kv[0]} slots of {kv[1]} that fit" if kv else "")
    if snap.left_out:
        head += f"  (left out: {', '.join(snap.left_out)})"
    lines = [head, ""]
    drifts = drift(snap.hosts)
    for r in snap.hosts:
        state = "reachable" if r.reachable else "unreachable"
        age = f" (last known {fmt.duration(r.age_s)} ago)" if r.snapshot is not None and not r.fresh and r.age_s else ""
        lines.append(f"=== {r.host} (node {r.node_rank}): {state}" + (f" — {r.error}" if r.error else "") + age
                     + ("  [left out]" if r.host in snap.left_out else ""))
        if r.snapshot is not None:
            tool = r.snapshot.toolchain
            lines.append(f"toolchain: dsv4 {tool.get('dsv4', '?')}, torch {tool.get('torch', '?')}, python "
                         f"{tool.get('python', '?')}" + "".join(f"\n  differs: {d}" for d in drifts.get(r.host, ())))
            if (problem := r.snapshot.blocking()) is not None:
                lines.append(f"blocks a launch: {problem.line()}")
            lines.append(render(r.snapshot))
        lines.append("")
    return "\n".join(lines)
