"""The one-host screen's top line: the model, the service (running, ended, or where `l` binds),
the settings every action carries, and the work under way."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from console import fmt


def topbar_line(app: Any, compact: bool) -> str:
    """`app` (console.tui.app.Dsv4Console)'s top line; `compact` (below 120 columns): the model's
    name only and the service before the settings, so the URL shows."""
    s = app.spec
    device = app.snapshot.settings.device if app.snapshot is not None else s.device
    plan = app.snapshot.plan if app.snapshot is not None else None
    backend = plan.backend if plan is not None and plan.backend else s.backend  # `auto` as the plan resolved it
    parts = [f"[b]dsv4-console[/]  model [b]{s.model.name if compact else s.model}[/]"]
    if app.service_control.running:
        service = f"[green]service {app.service_control.name()}[/]"
    elif app.launch and app.launch.ended and not app.launch.stopped:
        service = f"[red]service ended: {escape(app.launch.ended_line())}[/]"
    else:
        service = f"[dim]l binds {s.host}:{s.port}[/]"
    settings = [f"device {device}", f"backend {backend}"] + ([f"ranks {s.ranks}"] if s.ranks > 1 else [])
    if app.host is not None and not app.session.alone:
        parts.insert(0, f"[b reverse] {escape(app.host.name)} [/] [dim]{escape(app.host.where)} · F: the fleet[/]")
    reading = app.reading
    if reading is not None and (reading.error or not reading.fresh):  # what the panes show is not fresh
        age = f" {fmt.duration(reading.age_s)} old" if reading.age_s is not None and reading.snapshot else ""
        parts.insert(1 if len(parts) > 1 else 0, f"[yellow]{escape(reading.error or 'stale')}{age}[/]")
    if app.readonly:
        parts.append("[b reverse] READ-ONLY [/]")
    parts += [service, *settings] if compact else [*settings, service]
    running = [n for n in app.jobs_control.running() if app.jobs[n] is not app.service]
    if running:
        parts.append(f"[yellow]working: {', '.join(running)}[/]")
    return (" │ " if compact else "  │  ").join(parts)
