"""Nodes: this host's part of a service across hosts, as `dsv4 node start` runs it — one
`torchrun` agent (its ranks under it) watched by a small supervisor that records how it ended.

A record per node under `$DSV4_STATE_DIR/nodes/<agent pid>.json`: which node of how many, the
master it joined, the model, its log and events files, and, once it ended, how (exit status or
signal, and the log's last lines). A record whose agent is gone without an ending (the host lost
power, the supervisor was killed with it) reads as "gone". The fleet console reads these records
in every host's snapshot; `dsv4 node stop` stops a node by them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from store import atomic, safeio
from store.paths import state_dir

VERSION = 1
MAX_RECORD_BYTES = 64 << 10
LOG_LINES = 5  # of a node's log kept with its ending
_START_TOLERANCE = 0.05  # seconds: psutil's create_time rounding


def nodes_dir() -> Path:
    return state_dir() / "nodes"


@dataclass(frozen=True, kw_only=True)
class NodeEnding:
    """How a node ended: when, in words ("stopped by SIGTERM", "exited 1"), why (the failing rank's
    own words, when it said them), and its log's last lines."""

    at: float
    how: str
    reason: str = ""
    lines: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "how": self.how, "reason": self.reason, "lines": list(self.lines)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> NodeEnding:
        return cls(at=float(raw.get("at") or 0.0), how=str(raw.get("how") or "ended"),
                   reason=str(raw.get("reason") or ""), lines=tuple(str(x) for x in raw.get("lines") or ()))


@dataclass(frozen=True)
class Node:
    pid: int  # the torchrun agent
    create_time: float
    node_rank: int
    nnodes: int
    master: str  # ADDR:PORT of the rendezvous
    model: str
    log: str
    events: str
    supervisor: int = 0
    started: float = 0.0
    ending: NodeEnding | None = None
    argv: tuple[str, ...] = field(default_factory=tuple)
    service_logs: tuple[str, ...] = ()  # this host's ranks' own logs (runtime.log), rank order
    previous_log: str = ""  # the node before this one on this host: its torchrun log

    @property
    def alive(self) -> bool:
        """The agent still runs (the same process: pid and start time)."""
        with contextlib.suppress(psutil.Error, OSError):
            return abs(psutil.Process(self.pid).create_time() - self.create_time) <= _START_TOLERANCE
        return False

    def state(self) -> str:
        """running | how it ended ("stopped by SIGTERM", "exited 1", …) | gone."""
        if self.ending:
            return self.ending.how
        return "running" if self.alive else "gone"

    def record(self) -> dict[str, Any]:
        """What its file holds."""
        return {**asdict(self), "ending": self.ending.to_json() if self.ending else None, "argv": list(self.argv)}

    def to_json(self) -> dict[str, Any]:
        return {"v": VERSION, **self.record(), "state": self.state()}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Node:
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        known["argv"] = tuple(known.get("argv") or ())
        ending = raw.get("ending")
        known["ending"] = NodeEnding.from_json(ending) if isinstance(ending, dict) else None
        known["service_logs"] = tuple(str(p) for p in known.get("service_logs") or ())
        return cls(**known)


def _path(pid: int) -> Path:
    return nodes_dir() / f"{pid}.json"


def write(node: Node) -> None:
    path = _path(node.pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes_atomic(path, json.dumps(node.record()).encode())


def _read(path: Path) -> Node | None:
    raw = safeio.read_record(path, MAX_RECORD_BYTES)
    try:
        return Node.from_json(raw) if isinstance(raw, dict) else None
    except (ValueError, TypeError, KeyError):
        return None


def nodes() -> list[Node]:
    """Every node record of this host, newest first."""
    root = nodes_dir()
    try:
        names = [p for p in root.iterdir() if p.suffix == ".json" and not atomic.is_staging(p.name)]
    except OSError:
        return []
    found = [n for n in map(_read, names) if n is not None]
    return sorted(found, key=lambda n: n.started, reverse=True)


def ended(node: Node, code: int, asked: bool = False, reason: str = "") -> Node:
    """Record the agent's exit status (negative: the signal that killed it) and the cause in words
    (`reason`: the failing rank's own line, not torchrun's footer); `asked`: a stop was asked for
    (torchrun answers SIGTERM with exit 1: that is a stop, not a failure)."""
    from store.services import how, log_tail

    said = "stopped by SIGTERM" if asked and code != -signal.SIGKILL else how(code)
    done = replace(node, ending=NodeEnding(at=round(time.time(), 3), how=said, reason="" if asked else reason[:500],
                                           lines=tuple(log_tail(node.log, LOG_LINES))))
    write(done)
    return done


def _supervisor(node: Node) -> psutil.Process | None:
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(node.supervisor)
        if "supervise" in proc.cmdline():
            return proc
    return None


def stop(node: Node, timeout: float = 60.0) -> str:
    """SIGTERM through the node's supervisor (it passes it to the agent, which stops its ranks:
    rank 0 drains, and records the stop); SIGKILL to the agent and its ranks after `timeout`.
    How it ended, in words. A node that is not running is left as it is."""
    if not node.alive:
        return node.state()
    sup = _supervisor(node)
    with contextlib.suppress(ProcessLookupError):
        os.kill(sup.pid if sup is not None else node.pid, signal.SIGTERM)
    if (said := _ending(node, timeout)) is not None:
        return said
    with contextlib.suppress(psutil.Error):  # torchrun starts each rank in a session of its own
        agent = psutil.Process(node.pid)
        for proc in [*agent.children(recursive=True), agent]:
            with contextlib.suppress(psutil.Error):
                proc.kill()
    return _ending(node, 10.0) or "killed by SIGKILL"


def _ending(node: Node, timeout: float) -> str | None:
    """The node's recorded ending once its supervisor wrote it (None: not within `timeout`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = _read(_path(node.pid))
        if current is not None and current.ending:
            return current.state()
        if not node.alive and _supervisor(node) is None:
            return current.state() if current is not None else "gone"
        time.sleep(0.1)
    return None
