"""Every host is a Host, this one too: one interface (torch-free, no Textual) for what the console
and `dsv4 fleet` ask of a host, whatever carries it — pyinfra's connectors and Ansible's
connection plugins are the model.

A host
- runs a `dsv4` command line there, streaming its events and lines (`command`: the one funnel
  every action goes through, its stdin and stdout pipeable into another host's command);
- answers snapshots of the launch it was given (`watch`, then `ask` / `pending` / `reading`: a
  reading says when it is not fresh, and why, and keeps what was last known);
- follows a service's or a rank's log (`log`), and a node's, and the previous run's of each;
- tells what happened there (`timeline`: its services', nodes' and consoles' events, from its
  `store.timeline` files).

Three implementations: this host (`console.fleet.local`), a host over ssh with one shared
connection (`console.fleet.remote`), and a fake that records the commands it was given and
answers from a script (`console.fleet.fake`), for the orchestration's tests.
"""

from __future__ import annotations

import os
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from console.data.snapshot import Snapshot
from runtime.events import Event
from runtime.launch.spec import LaunchSpec
from store.timeline import TimelineEvent

OnEvent = Callable[[Any, Event], None]
OnLine = Callable[[Any, str, str], None]  # (command, "stdout" | "stderr", line)


@dataclass(frozen=True, kw_only=True)
class HostReading:
    """One host as the fleet sees it now: reachable or why not, and what was last known of it."""

    host: str
    node_rank: int
    reachable: bool
    error: str = ""  # why it is not reachable, or why its snapshot is not fresh
    snapshot: Snapshot | None = None  # the latest snapshot (kept while the host is away: `age_s` says how old)
    age_s: float | None = None  # seconds since that snapshot arrived
    fresh: bool = False  # it answered the latest request
    took_s: float | None = None  # the latest answer's round trip
    connecting: bool = False  # no answer yet, nor a failure: its first answer may still come

    @property
    def state(self) -> str:
        """fresh | stale (it says why: no answer for a while, or not a snapshot) | unreachable. An
        answer still on its way, within its time, is no news."""
        return "unreachable" if not self.reachable else "stale" if self.error else "fresh"

    def to_json(self) -> dict[str, Any]:
        """`host` (its name in the fleet), `reachable`, `error`, and the host's snapshot under one
        host's --once --json keys — but for that snapshot's own `host` part (CPU, memory, load),
        which is `host_stats` here."""
        snap = self.snapshot.to_json() if self.snapshot else {}
        if "host" in snap:
            snap["host_stats"] = snap.pop("host")
        return {**snap, "host": self.host, "node_rank": self.node_rank, "reachable": self.reachable,
                "error": self.error, "fresh": self.fresh, "age_s": None if self.age_s is None else round(self.age_s, 2)}


class LogFeed(ABC):
    """A log as it grows: `poll()` gives its complete new lines (the first poll: its last lines)."""

    label: str = "log"
    where: str = ""  # the file, as the host names it
    host_name: str = ""  # the host it is read on
    earlier: Callable[[], LogFeed] | None = None  # the previous run's log of the same (`p` in the log view)

    def start(self) -> None:
        """Begin following (an event loop runs)."""
        return None  # nothing to do for most hosts

    @abstractmethod
    def poll(self) -> list[str]:
        ...

    def close(self) -> None:
        """Stop following."""
        return None  # nothing to do for most hosts

    @property
    def error(self) -> str:
        """Why nothing more will come ("" while it may)."""
        return ""

    @property
    def running(self) -> bool:
        """More may come (a followed log always may)."""
        return True


TAIL_BYTES = 256 << 10  # what opening a log shows of its past


def read_from(path: str, offset: int | None) -> tuple[list[str], int]:
    """The complete lines of a regular file from `offset` (None: its last TAIL_BYTES), and the
    offset after them; never blocks on a FIFO, never follows a file that is not regular."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return [], offset or 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return [], offset or 0
        start = max(0, st.st_size - TAIL_BYTES) if offset is None else min(offset, st.st_size)
        data = os.pread(fd, min(st.st_size - start, 4 * TAIL_BYTES), start)
    finally:
        os.close(fd)
    end = data.rfind(b"\n") + 1  # a line still being written waits for its end
    lines = data[:end].decode(errors="replace").splitlines()
    if offset is None and start > 0 and lines:
        lines = lines[1:]  # the first line read from the middle of the file is a fragment
    return lines, start + end


class FileFeed(LogFeed):
    """A log file of this host, read as it grows."""

    def __init__(self, label: str, path: str, host_name: str = ""):
        self.label, self.where, self.host_name = label, path, host_name
        self.offset: int | None = None

    def poll(self) -> list[str]:
        lines, self.offset = read_from(self.where, self.offset)
        return lines


class Host(ABC):
    """One host of a fleet; the one-host console's is a fleet of one (see the module docstring)."""

    kind: ClassVar[str] = ""  # local | ssh | fake
    blocking: ClassVar[bool] = True  # `ask` may block (a collection, a connection): call it off the UI thread

    def __init__(self, name: str, node_rank: int = 0):
        self.name, self.node_rank = name, node_rank
        self.on_change: Callable[[], None] = lambda: None  # an answer arrived, or the host went away

    @property
    def where(self) -> str:
        """How a line names it: `host-a over ssh`, `this host`."""
        return self.name

    @property
    def rendezvous(self) -> str:
        """The address the other hosts reach this one at, as node 0 (`auto`: the address node 0
        reads from the connection that started it)."""
        return "auto"

    # -- the funnel: a dsv4 command line run there ---------------------------------------------

    @abstractmethod
    def command(self, name: str, args: Sequence[str], *, on_event: OnEvent | None = None,
                on_line: OnLine | None = None, stdin: int | None = None, stdout: int | None = None,
                detach: bool = False) -> Any:
        """`dsv4 ARGS` on this host, not started yet: `await .run()` runs it to its end (its exit
        code); `.stop()`, `.running`, `.pid`, `.stderr_tail` as `console.fleet.command.Worker`'s."""

    def why(self, code: int | None, stderr: Sequence[str]) -> str:
        """What a failed command means, in one line."""
        last = next((line.strip() for line in reversed(stderr) if line.strip()), "")
        return f"dsv4 exited {code}: {last}" if last else f"dsv4 exited {code}"

    # -- snapshots ------------------------------------------------------------------------------

    @abstractmethod
    def watch(self, spec: LaunchSpec, local_ranks: int | None = None) -> None:
        """Answer snapshots of the launch `spec` from now on (again: of this one instead);
        `local_ranks`: the service's ranks that run here."""

    @abstractmethod
    def ask(self, history: bool = False) -> None:
        """Ask for a fresh snapshot (`history`: with the launch history's last records)."""

    @abstractmethod
    def pending(self) -> bool:
        """Asked and not answered yet, while it still may answer."""

    @abstractmethod
    def reading(self, now: float) -> HostReading:
        """What is known of it now (`now`: time.monotonic())."""

    def replan(self) -> None:
        """Something the plan depends on changed here: plan again at the next ask."""
        return None  # nothing to do for most hosts

    def close(self) -> None:
        """The console is leaving: end what runs for it (snapshots, shared connections)."""
        return None  # nothing to do for most hosts

    # -- what happened there ------------------------------------------------------------------------

    async def timeline(self) -> list[TimelineEvent]:
        """Every event this host's timeline files keep (`dsv4 events --json` there, through the
        funnel), oldest first; a UserError saying why when it cannot be read."""
        from store import timeline
        from store.errors import UserError

        said: list[str] = []
        command = self.command("events", ("events", "--json"),
                               on_line=lambda _c, which, line: said.append(line) if which == "stdout" else None)
        code = await command.run()
        if code != 0:
            raise UserError(self.why(code, list(command.stderr_tail)))
        return timeline.parse(said)

    # -- logs -----------------------------------------------------------------------------------

    @abstractmethod
    def log(self, label: str, *, pid: int | None = None, rank: int | None = None, node: int | None = None,
            follow: bool = True, previous: bool = False) -> LogFeed:
        """A log of this host (followed as it grows, unless not `follow`): a service's (by pid;
        None: the newest), one of its ranks', or a node's (`console.data.logs.which_log`);
        `previous`: the previous run's, kept beside it."""


class CommandFeed(LogFeed):
    """A log followed by a command on its host (`dsv4 service log … --follow`, over that host's
    own connection): its lines as they come. Its stderr's first line says the file."""

    MAX = 20_000  # lines held between two polls

    def __init__(self, host: Host, label: str, args: Sequence[str]):
        from collections import deque

        self.host, self.label, self.where, self.host_name = host, label, "", host.name
        self.buffer: deque[str] = deque(maxlen=self.MAX)
        self.command = host.command(f"log {label}", args, on_line=self._line)
        self.task: Any = None
        self._error = ""

    def start(self) -> None:
        import asyncio

        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        code = await self.command.run()
        if code not in (0, None) and not self.command.stopping:
            self._error = self.host.why(code, list(self.command.stderr_tail))

    def _line(self, _command: Any, which: str, line: str) -> None:
        if which == "stdout":
            self.buffer.append(line)
        elif line.startswith(FOLLOWING) and not self.where:
            self.where = line.removeprefix(FOLLOWING).strip()

    def poll(self) -> list[str]:
        out = list(self.buffer)
        self.buffer.clear()
        return out

    @property
    def error(self) -> str:
        return self._error

    @property
    def running(self) -> bool:
        return self.task is None or not self.task.done()

    def close(self) -> None:
        import asyncio

        if self.command.running:
            asyncio.get_running_loop().create_task(self.command.stop(2.0))


FOLLOWING = "following "  # `dsv4 service log` says on stderr which file it follows: `following PATH`
