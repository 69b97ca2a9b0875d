"""The fleet screen: one row per host of the service — reachable (or why not), dsv4's version,
the toolchain against the other hosts, programs, sidecar, device memory and the KV it fits, room
for the sidecar on disk and in the page cache, the service's state, the ranks there and their
phases, tokens/s — sorted, filtered and opened like every table; Enter opens the one-host panes
fed by that host's snapshots. The actions run on the selected hosts (space marks several; none
marked: the one under the cursor, `a` marks all), each confirmed with the hosts it touches."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

from rich.markup import escape
from textual import work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import Screen
from textual.widgets import Footer, RichLog, Static

from console import fmt
from console.fleet.collector import FleetSnapshot
from console.fleet.rows import HostRow, kv_total, rows, slowest
from console.tui.filter_box import FilterBox
from console.tui.tables import Column, PaneTable, row_of, title
from store import timeline as T

REACH_ORDER = {"✗": 0, "stale": 1, "✓": 2}
EVENT_STYLE = {T.UNREACHABLE: "red", T.FAILED: "red", T.STALE: "yellow", T.BACK: "green", T.SERVING: "green",
               T.LEFT_OUT: "yellow"}
COLUMNS = (  # which host and whether it serves first; what differs and what is missing next
    Column("mark", " ", 1, essential=True),
    Column("host", "host", 12, essential=True),
    Column("reach", "ok", 5, essential=True, rank=REACH_ORDER),
    Column("state", "service", 18, essential=True),
    Column("tokens_s", "tok/s", 6, essential=True),
    Column("job", "action", 22, essential=True),
    Column("toolchain", "toolchain", 34),
    Column("programs", "programs", 14),
    Column("sidecar", "sidecar", 10),
    Column("node", "node", 4),
    Column("phases", "ranks", 22),
    Column("device", "device · KV/fits", 24),
    Column("room", "free disk · cache", 17),
    Column("version", "dsv4", 7),
    Column("age", "age", 5),
)


def _age(seconds: float | None) -> str:
    """A snapshot's age to the second ("now" under two: a refresh's own round trip)."""
    if seconds is None:
        return "-"
    return "now" if seconds < 2 else fmt.duration(seconds)


class FleetScreen(Screen):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("w", "app.mutate('warm')", "Warm", id="fleet.warm",
                tooltip="read the sidecar, then compile, on the hosts"),
        Binding("p", "app.mutate('prepack')", "Prepack", id="fleet.prepack", tooltip="pack a sidecar on the hosts"),
        Binding("b", "app.mutate('compile')", "Compile", id="fleet.compile", tooltip="compile what the launch misses"),
        Binding("x", "app.mutate('purge')", "Purge", id="fleet.purge",
                tooltip="delete what each host's plan calls stale or corrupt (lists each file first)"),
        Binding("u", "app.mutate('pull')", "Pull", id="fleet.pull", tooltip="pull missed entries from the registry"),
        Binding("i", "app.mutate('import')", "Import", id="fleet.import",
                tooltip="bring missed entries from another host of the fleet, signed"),
        Binding("l", "app.mutate('launch')", "Launch", id="fleet.launch",
                tooltip="start the service across every host not left out"),
        Binding("s", "app.mutate('stop')", "Stop", id="fleet.stop", tooltip="stop the service's nodes on the hosts"),
        Binding("minus", "app.mutate('leave_out')", "Leave out", key_display="-", id="fleet.leave_out",
                tooltip="leave the selected hosts out of the service (again: bring them back); the ranks, the "
                "plans and a launch cover the others"),
        Binding("space", "mark", "Mark", id="fleet.mark", show=False, tooltip="mark the host for the next action"),
        Binding("a", "mark_all", "All", id="fleet.all", show=False,
                tooltip="mark every host not left out (again: none)"),
        Binding("h", "history", "History", id="fleet.history", show=False,
                tooltip="every host's launch history, one record per launch"),
        Binding("e", "app.events", "Events", id="fleet.events", show=False,
                tooltip="what happened on every host, one timeline merged by time (each host's read over its "
                "connection; repeats counted)"),
        Binding("r", "refresh", "Refresh", id="fleet.refresh", show=False, tooltip="ask every host for a snapshot now"),
        Binding("slash", "app.filter", "Filter", key_display="/", id="fleet.filter", show=False,
                tooltip="filter the hosts (enter keeps it, esc clears it)"),
        Binding("question_mark", "help", "Help", key_display="?", id="fleet.help", tooltip="this screen's keys"),
        Binding("q", "app.quit_console", "Quit", id="fleet.quit", tooltip="quit (the hosts' services keep running)"),
    ]
    MUTATING = frozenset({"fleet.warm", "fleet.prepack", "fleet.compile", "fleet.purge", "fleet.pull",
                          "fleet.import", "fleet.launch", "fleet.stop", "fleet.leave_out"})

    def __init__(self, control: Any, interval: float = 2.0) -> None:
        super().__init__(id="fleet")
        self.control, self.interval = control, interval
        self.snapshot: FleetSnapshot | None = None
        self.marked: set[str] = set()
        self.needle = ""
        self.refreshes = 0
        self._said: tuple = ()  # what the table shows now (its cells), to skip a repaint that changes nothing

    def compose(self) -> ComposeResult:
        yield Static(id="fleet-top")
        with Vertical(id="fleet-body"):
            yield PaneTable("fleet", COLUMNS, self._cells, sort_key="node", id="fleet-table")
            yield Static(id="fleet-detail")
            yield RichLog(id="fleet-log", wrap=True, max_lines=2000, markup=True)
        yield FilterBox()
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(FilterBox).display = False
        self.query_one("#fleet-table").focus()
        for event in self.control.session.log.events():  # what happened before the screen came
            self.add_event(event)
        self.top()
        self.call_after_refresh(self.action_refresh)
        if self.interval > 0:
            self.set_interval(self.interval, self.action_refresh)
            self.set_interval(1.0, self._tick)

    # -- data ------------------------------------------------------------------------------------

    def action_refresh(self) -> None:
        self._collect()

    @work(thread=True, exclusive=True, group="fleet-collect")
    def _collect(self) -> None:
        snap = self.control.session.collector.snapshot()
        self.app.call_from_thread(self.apply, snap)

    def apply(self, snap: FleetSnapshot) -> None:
        self.snapshot = snap
        self.refreshes += 1
        self.show()

    def rows(self) -> list[dict[str, Any]]:
        """The table's rows: each host's `HostRow` (what its cells say), its action and mark."""
        if self.snapshot is None:
            return []
        out = []
        for row in rows(self.snapshot):
            job = self.control.jobs.get(row.host)
            out.append(row_of(row, job=job.line() if job else "", job_state="" if job is None else
                              "running" if job.running else "ok" if job.ok else "failed",
                              mark="•" if row.host in self.marked else ""))
        return out

    def _cells(self, r: dict[str, Any]) -> dict[str, str]:
        """A row's cells: what hosts said is text, never markup (a path in brackets stays a path)."""
        row: HostRow = r["value"]
        color = {"✓": "green", "stale": "yellow"}.get(row.reach, "red")

        def text(value: str, style: str = "") -> str:
            value = escape(value)
            return f"[{style}]{value}[/]" if style and value else value

        bad = not row.ok and (row.state.startswith(("ended", "failed", "blocked")) or row.reach != "✓")
        job_style = {"ok": "green", "failed": "red"}.get(r["job_state"], "")
        host = text(row.host, "dim" if row.left_out else "")
        return {"mark": r["mark"], "host": host + (" [dim](out)[/]" if row.left_out else ""),
                "reach": f"[{color}]{row.reach}[/]", "state": text(row.state, "red" if bad else ""),
                "tokens_s": fmt.per_second(row.tokens_s) if row.tokens_s is not None else "-",
                "job": text(r["job"], job_style), "node": str(row.node), "phases": text(row.phases),
                "programs": text(row.programs), "sidecar": text(row.sidecar),
                "device": text(row.device, "" if row.device_ok else "red"),
                "room": text(row.room, "" if row.roomy else "red"),
                "toolchain": text(row.toolchain, "yellow" if row.drift else ""), "version": text(row.version),
                "age": _age(row.age)}

    def _tick(self) -> None:
        """Once a second while an action runs: its elapsed time and ETA move between events."""
        if self.control.running():
            self.show()

    def show(self) -> None:
        """Render the rows — only when what they say changed (an idle fleet repaints nothing)."""
        rows = self.rows()
        said = (self.needle, tuple(tuple(self._cells(r).items()) for r in rows))
        if said == self._said:
            return
        self._said = said
        table = self.query_one("#fleet-table", PaneTable)
        shown, total = table.set_rows(rows, self.needle)
        self.top(shown, total, kv_total([r["value"] for r in rows]))
        self.detail()

    def top(self, shown: int = 0, total: int = 0, kv: tuple[int, int] | None = None) -> None:
        session = self.control.session
        s = session.spec
        readings = self.snapshot.hosts if self.snapshot else ()
        reachable = sum(1 for r in readings if r.reachable)
        head = title("Fleet", shown, total, self.needle, "hosts")
        behind = slowest(readings) if self.snapshot else ""
        head += f"  [yellow]{escape(behind)}[/]" if behind else ""
        model = s.model.name if s.model else "embedded default"
        active = len(session.active())
        service = f"ranks {s.ranks} over {active} host{'s' if active > 1 else ''}" + (
            f" · KV {kv[0]} slots (fits {kv[1]})" if kv else "")
        left = f"  [yellow]left out: {escape(', '.join(sorted(session.left_out)))}[/]" if session.left_out else ""
        source = session.fleet.source if session.fleet is not None else ""
        self.query_one("#fleet-top", Static).update(
            f"[b]dsv4-console[/]  {head} ({reachable} reachable)  │  model {escape(model)}  backend {s.backend}  "
            f"{service}  max-seq {s.max_seq}{left}  │  [dim]{escape(Path(source).name)}[/]")

    def detail(self) -> None:
        """The selected host: why it is not reachable, what blocks a launch there, its drift, its
        node and ranks."""
        table = self.query_one("#fleet-table", PaneTable)
        selected = table.selected()
        box = self.query_one("#fleet-detail", Static)
        if selected is None:
            box.update("")
            return
        row: HostRow = selected["value"]
        r = row.reading
        lines = [f"[b]{escape(row.host)}[/] node {row.node}"
                 + (f" ({escape(row.hostname)})" if row.hostname and row.hostname != row.host else "")
                 + (" [yellow]left out[/]" if row.left_out else "")
                 + (f" — [red]{escape(r.error)}[/]" if r.error else "")]
        lines += [f"  [yellow]{escape(d)}[/]" for d in row.drift]
        snap = r.snapshot
        if snap is not None and (problem := snap.blocking()) is not None:
            lines.append(f"  [red]blocks a launch: {escape(problem.line())}[/]")
        if snap is not None and snap.nodes:
            v = snap.nodes[0]
            n, ending = v.node, v.node.ending
            # how it ended is its cause (the failing rank's own words), never its log's last lines
            # (torchrun's footer): those are its log's, L shows them
            cause = ending.reason if ending else ""  # its state says how ("exited 1")
            lines.append(escape(f"  node {n.node_rank}/{n.nnodes} torchrun pid {n.pid} master {n.master}: {v.state}"
                                + (f" — {cause}" if cause else "")))
        box.update("\n".join(lines))

    def on_data_table_row_highlighted(self, _event) -> None:
        self.detail()

    # -- acting ------------------------------------------------------------------------------------

    def selection(self) -> list[str]:
        """The hosts an action runs on: the marked ones (in node order), else the one under the cursor."""
        if self.marked:
            return [h for h in self.control.session.hosts if h in self.marked]
        row = self.query_one("#fleet-table", PaneTable).selected()
        return [row["host"]] if row else []

    def action_help(self) -> None:
        from console.tui.screens.help import HelpScreen
        from console.tui.tables import PaneTable as Table

        keys = [b for b in [*self.BINDINGS, *Table.BINDINGS] if isinstance(b, Binding)]
        extra = (("enter", "open", "the selected host's own panes, from its snapshots (F comes back here)"),
                 ("ctrl+q", "quit", "the same as q"))
        self.app.push_screen(HelpScreen(keys, self.MUTATING, self.app.readonly, "fleet keys", extra))

    def action_mark(self) -> None:
        row = self.query_one("#fleet-table", PaneTable).selected()
        if row:
            self.marked ^= {row["host"]}
            self.show()

    def action_mark_all(self) -> None:
        every = set(self.control.session.active())  # a host left out is marked by hand
        self.marked = set() if self.marked == every else every
        self.show()

    @work(thread=True, exclusive=True, group="fleet-history")
    def action_history(self) -> None:
        from console.tui.screens.history import HistoryScreen

        records = self.control.session.collector.history()
        self.app.call_from_thread(self.app.push_screen, HistoryScreen(records))

    def on_pane_table_chosen(self, message: PaneTable.Chosen) -> None:
        message.stop()
        self.app.show_host(message.row["host"])

    def add_event(self, event: T.TimelineEvent) -> None:
        """An event in the fleet's log: its time and its sentence (never a raw record)."""
        if event.kind == T.PROGRESS:
            return
        stamp = time.strftime("%H:%M:%S", time.localtime(event.ts))
        style = EVENT_STYLE.get(event.kind, "red" if event.kind == T.ENDED and event.ok is False else "")
        text = escape(event.sentence())
        self.query_one("#fleet-log", RichLog).write(f"[dim]{stamp}[/] " + (f"[{style}]{text}[/]" if style else text))

    def filter(self, needle: str) -> None:
        """The console's filter, on this screen: the hosts."""
        self.needle = needle
        self.show()
