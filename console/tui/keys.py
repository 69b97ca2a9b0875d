"""Every key of the one-host screen, each a `Binding` with an id and a description (what the footer,
the help screen and the palette read), and the names of the actions that change something: what
the console's one guard (`Dsv4Console.action_mutate`) lets through, and `--readonly` refuses."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from textual.app import SystemCommand
from textual.binding import Binding, BindingType

MUTATING = frozenset({"prepack", "purge", "warm", "launch", "stop", "create", "dismiss"})  # the panes' actions
FLEET_MUTATING = frozenset({"warm", "prepack", "compile", "purge", "pull", "import", "launch", "stop", "leave_out"})

BINDINGS: list[BindingType] = [
    Binding("q", "quit_console", "Quit", id="quit", tooltip="quit (asks about a service this console runs)"),
    Binding("question_mark", "help", "Help", key_display="?", id="help", tooltip="this screen"),
    Binding("r", "refresh", "Refresh", id="refresh", show=False, tooltip="collect every pane now"),
    Binding("slash", "filter", "Filter", key_display="/", id="filter", show=False,
            tooltip="filter every pane's rows and the log (enter keeps it, esc clears it)"),
    Binding("z", "zoom", "Zoom", id="zoom", tooltip="maximise the focused pane (again: restore)"),
    Binding("h", "history", "History", id="history", show=False, tooltip="past launches, newest first"),
    Binding("e", "events", "Events", id="events", show=False,
            tooltip="what happened: services, hosts and actions, one timeline merged by time (repeats counted)"),
    Binding("c", "kernel_cache", "Kernel cache", id="kernel-cache", show=False,
            tooltip="Programs pane: next launch's programs ↔ the kernel cache's entries"),
    Binding("ctrl+s", "save_log", "Save log", id="save-log", show=False,
            tooltip="write the log to a file under the state dir"),
    Binding("p", "mutate('prepack')", "Prepack", id="prepack",
            tooltip="pack the checkpoint into a sidecar (progress in Sidecars)"),
    Binding("w", "mutate('warm')", "Warm", id="warm",
            tooltip="read the sidecar into the page cache, then compile"),
    Binding("x", "mutate('purge')", "Purge", id="purge",
            tooltip="delete what the plan calls stale or corrupt; in the kernel cache view, every entry "
            "that can never be used again (asks; lists why)"),
    Binding("l", "mutate('launch')", "Launch", id="launch",
            tooltip="dsv4 serve on --host/--port, detached (see Registration)"),
    Binding("s", "mutate('stop')", "Stop", id="stop",
            tooltip="stop the service selected in Services (that pane focused; asks first)"),
    Binding("d", "mutate('dismiss')", "Dismiss", id="dismiss", show=False,
            tooltip="forget the ended service selected in Services (it stays a row until then)"),
    Binding("L", "service_log", "Service log", id="service-log", show=False,
            tooltip="the log of the service selected in Services (tab: each rank's; / searches)"),
    Binding("F", "fleet", "Fleet", id="fleet", show=False,
            tooltip="--hosts/--fleet: back to every host of the service"),
]


def system_commands(app: Any) -> Iterable[SystemCommand]:
    """The palette's commands (ctrl+p): every key of the console by name; read-only hides the
    mutating ones."""
    from console.tui.tables import PaneTable

    def run(binding: Binding) -> None:
        if binding in PaneTable.BINDINGS:  # a table's own action: on the focused table
            table = app.focused if isinstance(app.focused, PaneTable) else app.pane("#programs-table")
            if table is not None:
                table.run_action(binding.action)
        else:
            app.run_action(binding.action)

    for b in app.all_bindings():
        name = b.id or b.action
        if app.readonly and name in MUTATING:
            continue
        yield SystemCommand(f"{b.description or name} ({b.key_display or b.key})", b.tooltip or b.description,
                            lambda b=b: run(b))
    yield SystemCommand("Theme", "change the colour theme", app.action_change_theme)
