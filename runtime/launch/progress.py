"""Each rank's progress as the others read it, and each host's as rank 0 shows it (torch-free).

A rank posts its last event in the rendezvous store (`Progress`, throttled): a rank waiting at a
sync point judges another by whether it moves (runtime.launch.rank_store), and rank 0, while it
registers, reads every rank's to show each host's phase and progress and to name the slowest
host (`summarize`): in its events whenever a host's phase or the slowest changes, and on its
/health (503 `registering`, runtime.contract). One value both sides of the store read with
this module, never a string each side parses for itself.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.contract import HostProgress

# how far along registration a phase is; programs and weights run at once, so they rank alike
STAGE = {"start": 0, "check": 0, "programs": 1, "weights": 1, "upload": 2, "kv": 3, "validate": 4, "serve": 5}
WATCH_EVERY_S = 0.5  # rank 0 reads every rank's progress this often while it registers
HOSTS_DETAIL = "hosts"  # the detail key of rank 0's events about the hosts (not a rank's own progress)


@dataclass(frozen=True)
class Progress:
    """A rank's last event as it posts it: `posts` counts the posts (a wait sees it move)."""

    posts: int
    phase: str
    kind: str
    done: float | None = None
    total: float | None = None
    unit: str = ""

    @property
    def counted(self) -> bool:
        return self.done is not None and self.total is not None

    @property
    def doing(self) -> str:
        """`programs 5/14 programs` (an end says so: `weights end`)."""
        count = f" {self.done:g}/{self.total:g} {self.unit}".rstrip() if self.counted else ""
        return f"{self.phase}{count}" + (f" {self.kind}" if self.kind == "end" else "")

    def line(self) -> str:
        return json.dumps({"posts": self.posts, "phase": self.phase, "kind": self.kind, "done": self.done,
                           "total": self.total, "unit": self.unit}, sort_keys=True)

    @classmethod
    def from_line(cls, text: str | None) -> Progress | None:
        """A posted progress; None for nothing posted or anything this version cannot read."""
        try:
            raw = json.loads(text or "")
            return cls(int(raw["posts"]), str(raw["phase"]), str(raw["kind"]), raw.get("done"), raw.get("total"),
                       str(raw.get("unit") or ""))
        except (ValueError, TypeError, KeyError):
            return None


def _behind(phase: str, progress: Progress | None) -> tuple[int, float]:
    """How far a rank is: its phase's stage, then the fraction of its last count in that stage."""
    stage = STAGE.get(phase, 0)
    fraction = 0.0
    if progress is not None and progress.counted and STAGE.get(progress.phase) == stage and progress.total:
        fraction = min(1.0, float(progress.done) / float(progress.total))
    return stage, fraction


def summarize(hosts: list[str], phases: dict[int, str],
              progress: dict[int, Progress | None]) -> tuple[tuple[HostProgress, ...], str]:
    """Each host (in the order of its lowest rank) with the phase and progress of its least
    advanced rank, and the slowest host: the one furthest behind, when some host is ahead of it
    ("" for one host, or when every host is as far as the others)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    out, how_far = [], {}
    for host, ranks in by_host.items():
        last = min(ranks, key=lambda r: (_behind(phases.get(r, "start"), progress.get(r)), r))
        phase, p = phases.get(last, "start"), progress.get(last)
        how_far[host] = _behind(phase, p)
        counted = p is not None and p.counted and STAGE.get(p.phase) == STAGE.get(phase, 0)
        out.append(HostProgress(host, tuple(ranks), phase, p.done if counted else None,
                                p.total if counted else None, p.unit if counted else "", p.phase if counted else ""))
    slowest = min(how_far, key=lambda h: how_far[h]) if len(how_far) > 1 else ""
    if slowest and how_far[slowest] == max(how_far.values()):
        slowest = ""
    return tuple(out), slowest


def said(hosts: tuple[HostProgress, ...], slowest: str) -> str:
    """`hosts: host-a kv; host-b programs 3/8 programs (slowest)`."""
    return "hosts: " + "; ".join(f"{h.host} {h.doing}" + (" (slowest)" if h.host == slowest else "") for h in hosts)


class HostsWatch:
    """Rank 0 while it registers: every WATCH_EVERY_S, each rank's phase and progress read
    (`read(rank)` → (phase, Progress | None), on a store connection of the watch's own), each
    host's summary handed to `update(ranks, hosts, slowest)` (what /health says), and an event
    (`emit(message, detail)`) whenever a host's phase or the slowest host changes."""

    def __init__(self, hosts: list[str], read: Callable[[int], tuple[str, Progress | None]],
                 update: Callable[[list[dict[str, Any]], tuple[HostProgress, ...], str], None] | None,
                 emit: Callable[[str, dict[str, Any]], None], members: Callable[[int], dict[str, Any]]):
        self.hosts, self.read, self.update, self.emit, self.members = list(hosts), read, update, emit, members
        self._stop = threading.Event()
        self._said: tuple | None = None
        self._known: dict[int, dict[str, Any]] = {}

    def start(self) -> HostsWatch:
        threading.Thread(target=self._run, daemon=True, name="hosts-watch").start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def once(self) -> None:
        """One pass: read every rank, tell `update`, and say it when it changed."""
        phases, progress = {}, {}
        for rank in range(len(self.hosts)):
            phases[rank], progress[rank] = self.read(rank)
        hosts, slowest = summarize(self.hosts, phases, progress)
        if self.update is not None:
            self.update(self._ranks(phases), hosts, slowest)
        shape = (tuple((h.host, h.phase) for h in hosts), slowest)
        if len(hosts) > 1 and shape != self._said:
            self._said = shape
            self.emit(said(hosts, slowest), {HOSTS_DETAIL: [h.to_json() for h in hosts], "slowest": slowest})

    def _ranks(self, phases: dict[int, str]) -> list[dict[str, Any]]:
        out = []
        for rank, host in enumerate(self.hosts):
            if rank not in self._known:
                with contextlib.suppress(Exception):  # posted once it beats; until then, what the join said
                    if m := self.members(rank):
                        self._known[rank] = m
            m = self._known.get(rank, {})
            out.append({"rank": rank, "host": host, "pid": m.get("pid"), "device": m.get("device", ""),
                        "phase": phases.get(rank, "")})
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a store that stops answering: the heartbeat says so
                self.once()
            self._stop.wait(WATCH_EVERY_S)
