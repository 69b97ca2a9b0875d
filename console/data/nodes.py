"""This host's service nodes (`store.nodes`: what `dsv4 node start` runs) as a snapshot carries
them: each record with its state, and where its ranks are in registration, from the tail of the
node's own events file (each rank's phase, done/total, since when; the error that ended one)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from runtime.events import EventError, parse
from store import safeio
from store.nodes import Node

EVENTS_TAIL = 256 << 10  # a launch's events are a few hundred lines; its tail holds every rank's latest
SHOWN = 8  # records carried (newest first)
RUNNING, DONE, ERROR = "running", "done", "error"


@dataclass(frozen=True, kw_only=True)
class NodeRank:
    """One rank of a node as its own events tell it: the phase it is in, and how far."""

    rank: int
    host: str = ""
    phase: str = ""
    state: str = RUNNING  # running | done | error
    done: float | None = None
    total: float | None = None
    unit: str | None = None
    since: float | None = None  # when its phase started
    ts: float | None = None  # its latest event
    error: str = ""

    def eta(self) -> float | None:
        """Seconds left in its phase at the rate it has shown (None: nothing to go by)."""
        if None in (self.done, self.total, self.since, self.ts) or not self.done or self.ts <= self.since:
            return None
        return (self.total - self.done) * (self.ts - self.since) / self.done

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.done is not None and self.total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> NodeRank:
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


@dataclass(frozen=True, kw_only=True)
class NodeView:
    """A node record of this host, its state now, and its ranks' progress."""

    node: Node
    state: str  # running | how it ended | gone
    ranks: tuple[NodeRank, ...] = ()

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    def registering(self) -> list[NodeRank]:
        """Its ranks still in registration (before serve), while the node runs."""
        from runtime.events import REGISTRATION

        return [r for r in self.ranks if r.phase in REGISTRATION and r.state != ERROR] if self.running else []

    def to_json(self) -> dict[str, Any]:
        return {**self.node.to_json(), "state": self.state, "ranks": [r.to_json() for r in self.ranks]}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> NodeView:
        return cls(node=Node.from_json(dict(raw)), state=str(raw.get("state") or "gone"),
                   ranks=tuple(NodeRank.from_json(r) for r in raw.get("ranks") or ()))


def progress(events_path: str) -> tuple[NodeRank, ...]:
    """Each rank's latest: phase, state (running | done | error), done/total/unit, the phase's
    start and last event times, and an error's message."""
    ranks: dict[int, NodeRank] = {}
    for line in safeio.tail_lines(events_path, EVENTS_TAIL):
        try:
            e = parse(line)
        except EventError:
            continue
        if e.kind == "log":
            continue
        rank = e.rank or 0
        row = ranks.get(rank) or NodeRank(rank=rank)
        changes: dict[str, Any] = {"host": e.host or row.host, "ts": e.ts,
                                   "state": {"end": DONE, "error": ERROR}.get(e.kind, RUNNING)}
        if e.kind == "start" or row.phase != e.phase:
            changes.update(phase=e.phase, since=e.ts, done=None, total=None, unit=None, error="")
        if e.kind == "progress":
            changes.update(done=e.done, total=e.total, unit=e.unit)
        if e.kind == "error":
            changes["error"] = e.message or ""
        ranks[rank] = replace(row, **changes)
    return tuple(ranks[r] for r in sorted(ranks))


def node_views() -> tuple[NodeView, ...]:
    from store import nodes

    return tuple(NodeView(node=n, state=n.state(), ranks=progress(n.events) if n.events else ())
                 for n in nodes.nodes()[:SHOWN])
