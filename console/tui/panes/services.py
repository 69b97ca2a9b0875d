"""Services pane: every `dsv4 serve` of this user on the host (whoever started it), running or
ended: its state (an ended one says how, until `d` dismisses it), identity, settings and what it
serves now, in the order the field reads a service: errors, saturation (running/queued, KV in use),
tail latency (ttft, itl, e2e p50/p99, queue p99, each with its unit; `>5.1 s` past the top bucket),
throughput (prefill and generation tokens/s apart, the latter's last minute as a sparkline with its
top, requests/s); the details add finish reasons and each rank's CPU and RSS. `s` stops the
selected one, `L` opens its log. Collapsed (below 120×36) the summary's one line is every
service's state and tokens/s."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.markup import escape
from textual.app import ComposeResult
from textual.widgets import Static

from console import fmt
from console.data.services import ServicesSnapshot, ServiceView, Serving
from console.tui.panes.base import Pane
from console.tui.tables import Column, PaneTable, title

STATE_COLOR = {"serving": "green", "registering": "yellow", "failed": "red", "unreachable": "red", "ended": "red"}
STATE_ORDER = {"failed": 0, "ended": 1, "unreachable": 2, "registering": 3, "serving": 4}  # problems first
COLUMNS = (  # which service and how it is first; then as the field reads a service: errors, saturation, tail
    # latency, throughput (a narrow pane keeps the essential ones, then the others in this order)
    Column("state", "state", 8, essential=True, rank=STATE_ORDER),
    Column("pid", "pid", 7, essential=True),
    Column("errors", "4xx/5xx/503", 11),
    Column("load", "run/queue", 9),
    Column("kv", "kv", 4),
    Column("ttft", "ttft p50/p99", 13),
    Column("itl", "itl p50/p99", 13),
    Column("e2e", "e2e p50/p99", 13),
    Column("queue_wait", "queue p99", 9),
    Column("prompt_s", "prefill tok/s", 13),
    Column("tokens_s", "gen tok/s", 9, essential=True),
    Column("trend", "gen 1m, max", 14),  # the last minute of generation tokens/s, a sparkline and its top
    Column("requests_s", "req/s", 5),
    Column("url", "url", 15),
    Column("backend", "backend", 7),
    Column("max_seq", "max-seq", 7),
    Column("ranks", "ranks", 5),
    Column("model", "model", 12),
    Column("origin", "by", 7),
    Column("up", "up", 6),
)


FIGURE_KEYS = ("errors", "load", "kv", "ttft", "itl", "e2e", "queue_wait", "prompt_s", "tokens_s", "trend",
               "requests_s")  # the columns a service's figures fill ("-" without them)


def pair(s: Serving, kind: str) -> str:
    """`31 ms/120 ms`, `640 ms/>5.1 s`: a latency's p50 and p99, each with its unit."""
    return f"{fmt.latency(s.latency(f'{kind}_p50'))}/{fmt.latency(s.latency(f'{kind}_p99'))}"


def cells(view: ServiceView, now: float) -> dict[str, str]:
    color = STATE_COLOR.get(view.state, "yellow")
    s = view.serving
    record = view.record
    figures = {"errors": f"{s.errors_4xx}/{s.errors_5xx}/{s.busy_503}", "load": f"{s.running}/{s.queued}",
               "kv": "-" if s.kv_fraction is None else f"{s.kv_fraction:.0%}", "ttft": pair(s, "ttft"),
               "itl": pair(s, "itl"), "e2e": pair(s, "e2e"), "queue_wait": fmt.latency(s.latency("queue_p99")),
               "prompt_s": fmt.per_second(s.prompt_tokens_s), "tokens_s": fmt.per_second(s.tokens_s),
               "trend": fmt.spark(s.history.get("tokens_s", ())), "requests_s": fmt.per_second(s.requests_s),
               } if s else {}
    return {
        "state": f"[{color}]{view.state}[/]", "pid": str(view.pid),
        "url": view.url.removeprefix("http://") if view.url else "-",
        **dict.fromkeys(FIGURE_KEYS, "-"), **figures,
        "backend": view.backend or "-", "max_seq": str(view.max_seq or "-"), "ranks": str(view.rank_count),
        "model": Path(view.model).name, "origin": "console" if view.from_console else "shell",
        "up": fmt.duration(now - record.create_time) if not view.ended else "-",
    }


def row(view: ServiceView, now: float) -> dict[str, Any]:
    """The table's row: the sortable values beside the typed view (what actions act on)."""
    s = view.serving
    return {"view": view, "state": view.state, "pid": view.pid, "tokens_s": s.tokens_s if s else None,
            "prompt_s": s.prompt_tokens_s if s else None,
            "requests_s": s.requests_s if s else None, "url": view.url, "model": view.model,
            "backend": view.backend, "max_seq": view.max_seq, "ranks": view.rank_count,
            "up": now - view.record.create_time, **view.to_json()}


def serving_lines(s: Serving) -> list[str]:
    """What a service serves, in the field's order, every latency with its unit (the details and
    `--once`): errors and saturation, tail latency, throughput, finish reasons."""
    window = ("last 10 s, its own" if s.source == "10s" else f"last {s.window_s:.0f} s, scraped" if s.window_s > 0
              else "an older service: rates after a second scrape")
    kv = "-" if s.kv_fraction is None else f"{s.kv_used}/{s.kv_slots} ({s.kv_fraction:.0%})"
    lines = [f"errors 4xx {s.errors_4xx} · 5xx {s.errors_5xx} · 503 {s.busy_503} · running {s.running} · "
             f"queued {s.queued} (wait p99 {fmt.latency(s.latency('queue_p99'))}) · kv {kv}",
             f"p50/p99 ttft {pair(s, 'ttft')} · itl {pair(s, 'itl')} · e2e {pair(s, 'e2e')}",
             f"prefill {fmt.per_second(s.prompt_tokens_s)} tok/s · gen {fmt.per_second(s.tokens_s)} tok/s · "
             f"{fmt.per_second(s.requests_s)} req/s  [dim]({window})[/]"]
    if s.finished:
        lines.append("finished " + " · ".join(f"{reason or '?'} {n}" for reason, n in sorted(s.finished.items())))
    return lines


def rank_line(view: ServiceView) -> str:
    """`rank 0 pid 41 cpu serve 12/32 slots cpu 98% rss 1.2 GiB · rank 1 … beat 0.4 s`: each rank
    with its process's CPU (100 %: one core) and resident memory where the service says them."""
    parts = []
    for r in view.ranks:
        beat = "" if r.heartbeat_age is None or r.rank == 0 else f" beat {r.heartbeat_age:.1f} s"
        host = f" {r.host}" if r.host and r.host != view.record.host else ""
        use = "" if r.cpu_percent is None else f" cpu {r.cpu_percent:.0f}%"
        use += "" if r.rss_bytes is None else f" rss {fmt.size(r.rss_bytes)}"
        parts.append(f"rank {r.rank}{host} pid {r.pid or '?'} {r.device or '-'} {r.phase or '-'}{beat}"
                     f" {r.slots - r.free_slots}/{r.slots} slots{use}"
                     + (f" [red]{escape(r.error)}[/]" if r.error else ""))
    return " · ".join(parts)


def ranks_worth_a_line(view: ServiceView) -> bool:
    """Several ranks, or one whose process's CPU or RSS the service says."""
    return len(view.ranks) > 1 or any(r.cpu_percent is not None or r.rss_bytes is not None for r in view.ranks)


def summary(view: ServiceView, now: float) -> list[str]:
    """The selected service in full: identity and state first (a collapsed pane shows line one)."""
    s = view.serving
    head = f"pid {view.pid} {view.url or view.record.state} [{STATE_COLOR.get(view.state, 'yellow')}]{view.state}[/]"
    if s and s.tokens_s is not None:
        head += f" {s.tokens_s:.1f} tok/s"  # generation
    lines = [head]
    if view.ended:
        lines.append(f"[red]{escape(view.ending_line(now))}[/]  [dim](d dismisses)[/]")
        if view.record.ending.log:  # its last log lines are in its details (enter)
            lines.append(f"[dim]last log:[/] {escape(view.record.ending.log[-1])}  [dim](enter: its last "
                         f"{len(view.record.ending.log)} lines)[/]")
    elif view.detail is not None and view.detail.reason:
        lines.append(f"[red]{view.detail.reason}[/]")
    if view.problem:
        lines.append(f"[yellow]{view.problem}[/]")
    if s is not None:
        lines += serving_lines(s)
    if ranks_worth_a_line(view):
        lines.append(rank_line(view))
    logs = view.logs()
    lines.append(f"[dim]log[/] {logs[0][1] if logs else '-'}" + ("  [dim](L opens it)[/]" if logs else ""))
    return lines


def overview(views: tuple[ServiceView, ...]) -> str:
    """Every service's state and tokens/s on one line (`4242 serving 182 tok/s · 4300 ended`):
    what a collapsed pane keeps of each."""
    parts = []
    for v in views:
        tokens = v.serving.tokens_s if v.serving else None
        parts.append(f"{v.pid} [{STATE_COLOR.get(v.state, 'yellow')}]{v.state}[/]"
                     + (f" {fmt.per_second(tokens)} tok/s" if tokens is not None else ""))
    return " · ".join(parts)


class ServicesPane(Pane):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.now = 0.0

    def compose(self) -> ComposeResult:
        yield PaneTable("services", COLUMNS, lambda r: cells(r["view"], self.now), id="services-table",
                        sort_key="state")
        yield Static(id="services-summary", classes="totals")

    def on_mount(self) -> None:
        self.border_title = "Services"

    def show(self, snap: ServicesSnapshot, now: float, needle: str = "") -> None:
        self.now = now
        table = self.query_one(PaneTable)
        shown, total = table.set_rows([row(v, now) for v in snap.services], needle)
        self.border_title = title("Services", shown, total, needle)
        if snap.error:
            text = f"[red]{snap.error}[/]"
        elif not snap.services:
            text = "[dim]no dsv4 serve running on this host (l launches one)[/]"
        else:
            sel = table.selected() or {"view": snap.services[0]}
            lines = summary(sel["view"], time.time())
            if len(snap.services) > 1 and self.screen.has_class("-compact"):  # its one line: every service
                lines.insert(0, overview(snap.services))
            text = "\n".join(lines)
        self.query_one("#services-summary", Static).update(text)

    def selected(self) -> ServiceView | None:
        row = self.query_one(PaneTable).selected()
        return row["view"] if row else None
