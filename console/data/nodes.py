"""This host's service nodes (`store.nodes`: what `dsv4 node start` runs) as a snapshot carries
them: each record with its state, and where its ranks are in registration, from the tail of the
node's own events file (each rank's phase, done/total, since when; the error that ended one)."""

from __future__ import annotations

from typing import Any

from runtime.events import EventError, parse
from store import safeio

EVENTS_TAIL = 256 << 10  # a launch's events are a few hundred lines; its tail holds every rank's latest
SHOWN = 8  # records carried (newest first)


def progress(events_path: str) -> list[dict[str, Any]]:
    """Each rank's latest: phase, state (running | done | error), done/total/unit, the phase's
    start and last event times, and an error's message."""
    ranks: dict[int, dict[str, Any]] = {}
    for line in safeio.tail_lines(events_path, EVENTS_TAIL):
        try:
            e = parse(line)
        except EventError:
            continue
        if e.kind == "log":
            continue
        rank = e.rank or 0
        row = ranks.setdefault(rank, {"rank": rank})
        row["host"] = e.host or row.get("host", "")
        if e.kind == "start" or row.get("phase") != e.phase:
            row.update(phase=e.phase, since=e.ts, done=None, total=None, unit=None, error="")
        row.update(ts=e.ts, state={"end": "done", "error": "error"}.get(e.kind, "running"))
        if e.kind == "progress":
            row.update(done=e.done, total=e.total, unit=e.unit)
        if e.kind == "error":
            row["error"] = e.message or ""
    return [ranks[r] for r in sorted(ranks)]


def node_views() -> tuple[dict[str, Any], ...]:
    from store import nodes

    out = []
    for node in nodes.nodes()[:SHOWN]:
        row = node.to_json()
        row["ranks"] = progress(node.events) if node.events else []
        out.append(row)
    return tuple(out)
