"""This host, as a Host: its commands are `dsv4` run by this interpreter, its snapshots collected
in this process (`console.data.collectors`, no subprocess, no ssh), its logs read from its files."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from console.data.snapshot import LOCAL, Snapshot
from console.fleet.command import Worker, dsv4
from console.fleet.host import FileFeed, Host, HostReading, LogFeed, OnEvent, OnLine
from runtime.launch.spec import LaunchSpec
from store.timeline import TimelineEvent


def _ignore(*_: Any) -> None:
    pass


class LocalHost(Host):
    kind = "local"

    def __init__(self, name: str = LOCAL, node_rank: int = 0):
        super().__init__(name, node_rank)
        self.collectors: Any = None  # console.data.collectors.Collectors of the watched launch
        self.watched: tuple[LaunchSpec, int | None] | None = None
        self.latest: Snapshot | None = None
        self.received: float | None = None  # monotonic time of the latest snapshot
        self.took: float | None = None
        self.error = ""

    @property
    def where(self) -> str:
        return "this host"

    def command(self, name: str, args: Sequence[str], *, on_event: OnEvent | None = None,
                on_line: OnLine | None = None, stdin: int | None = None, stdout: int | None = None,
                detach: bool = False) -> Worker:
        return Worker(name, dsv4(*args), on_event=on_event or _ignore, on_line=on_line or _ignore, stdin=stdin,
                      stdout=stdout, detach=detach)

    def watch(self, spec: LaunchSpec, local_ranks: int | None = None) -> None:
        from console.data.collectors import Collectors

        if self.watched != (spec, local_ranks):
            self.watched = (spec, local_ranks)
            self.collectors = Collectors(spec, local_ranks)

    def ask(self, history: bool = False) -> None:
        """Collect now, in the caller's thread (the console's collect worker)."""
        if self.collectors is None:
            self.error = "nothing watched yet"
            return
        started = time.monotonic()
        try:
            self.latest = self.collectors.snapshot(with_history=history)
            self.error = ""
        except Exception as e:  # a collector bug must not take the console down: the reading says it
            self.error = f"collect failed: {type(e).__name__}: {e}"
        self.received = time.monotonic()
        self.took = self.received - started
        self.on_change()

    def pending(self) -> bool:
        return False

    def reading(self, now: float) -> HostReading:
        age = None if self.received is None else now - self.received
        return HostReading(host=self.name, node_rank=self.node_rank, reachable=True, error=self.error,
                           snapshot=self.latest, age_s=age, fresh=self.latest is not None and not self.error,
                           took_s=self.took)

    def services_scrape(self) -> None:
        """A first scrape of every live service's /metrics (rates need two: `--once`)."""
        if self.collectors is not None:
            self.collectors.services()

    def replan(self) -> None:
        if self.collectors is not None:
            self.collectors.plans.invalidate()

    async def timeline(self) -> list[TimelineEvent]:
        """This host's timeline files, read here (off the event loop)."""
        import asyncio

        from store import timeline

        return await asyncio.to_thread(timeline.read_dir)

    def log(self, label: str, *, pid: int | None = None, rank: int | None = None, node: int | None = None,
            follow: bool = True, previous: bool = False) -> LogFeed:
        from console.data.logs import which_log

        found, path = which_log(pid, rank, node, previous)
        return FileFeed(label or found, path, self.name)
