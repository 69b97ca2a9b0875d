"""A rank's side of the rendezvous store (a TCPStore: torchrun's agent, our launcher or rank 0
hosts it): who this process is (`RankEnv`), and what the ranks of one service tell each other
through the store (`RankStore`): joins, sync points of registration, each rank's phase and
progress, heartbeats, the lines naming each rank's last error, and the one `abort` line every
rank watches. The process group's side (the per-step link) is `runtime.launch.ranks.Group`,
built on this one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from runtime.launch.liveness import Heartbeat, first_line, roster
from runtime.launch.progress import HOSTS_DETAIL, HostsWatch, Progress
from store.errors import UserError

PREFIX = "dsv4/"
POLL_S = 0.05
PROGRESS_EVERY_S = 0.5  # a rank posts its progress at most this often; a waiter reads it as often
SHOW_WAIT_EVERY_S = 5.0  # a waiting rank says whom it waits for, and what they do, this often
PHASE_SECONDS = "phase-seconds"  # where each rank posts its phases' seconds once it registered
PHASE_SECONDS_WAIT_S = 5.0  # rank 0 waits this long at most for them (the others post as it serves)


class RankError(UserError):
    """The ranks cannot form (or keep) one service; the message names the rank and why."""


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the service, from the torchrun environment."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    addr: str
    port: int
    agent_store: bool  # torchrun's agent (or our launcher) hosts the store; else rank 0 does
    torchrun: bool = False  # torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE)

    @property
    def store_host(self) -> str:
        return "torchrun's agent" if self.torchrun else "the launcher" if self.agent_store else "rank 0"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RankEnv | None:
        """None unless RANK and WORLD_SIZE are set; a malformed variable is one line."""
        env = os.environ if environ is None else environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None

        def number(name: str, default: str | None = None, lo: int = 0, hi: int = 1 << 16) -> int:
            text = env.get(name, default)
            try:
                value = int(text)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise RankError(f"{name}={text!r} is not a number; torchrun sets it, or set it yourself") from None
            if not lo <= value <= hi:
                raise RankError(f"{name}={value} is out of range {lo}..{hi}")
            return value

        world = number("WORLD_SIZE", lo=1)
        rank = number("RANK", hi=world - 1)
        local_world = number("LOCAL_WORLD_SIZE", str(world), lo=1, hi=world)
        local_rank = number("LOCAL_RANK", str(rank), hi=local_world - 1)
        port = number("MASTER_PORT", "29500", lo=1, hi=65535)
        torchrun = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        agent = torchrun or env.get("DSV4_AGENT_STORE") == "1"
        return cls(rank, world, local_rank, local_world, env.get("MASTER_ADDR", "127.0.0.1"), port, agent, torchrun)

    def child_env(self) -> dict[str, str]:
        """The variables that make a process this rank (what our launcher sets)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world), "MASTER_ADDR": self.addr,
                "MASTER_PORT": str(self.port), "DSV4_AGENT_STORE": "1" if self.agent_store else "0"}


def own_address(master: str) -> str:
    """This host's address on the network the operator named with MASTER_ADDR (--master-addr):
    the master's own when it is a loopback address (every rank on this host), else the source
    address of this host's route to it — where this rank's process group listens."""
    try:
        family, _, _, _, where = socket.getaddrinfo(master, 9, type=socket.SOCK_DGRAM)[0]
    except socket.gaierror as e:
        raise RankError(f"MASTER_ADDR {master} does not resolve ({e.strerror})") from None
    if ipaddress.ip_address(where[0]).is_loopback:
        return where[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no packet is sent: the route is looked up
        try:
            probe.connect(where)
        except OSError as e:
            raise RankError(f"MASTER_ADDR {master}: this host has no route to it ({e.strerror})") from None
        return probe.getsockname()[0]


def listening(addr: str, port: int) -> socket.socket:
    """A socket listening on `addr`:`port` (0: a free one) and on no other address: a TCPStore
    left to itself listens on every interface (`*:port`), whatever host name it is given."""
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    family, _, _, _, where = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(4096)
    except OSError:
        sock.close()
        raise
    return sock


def bound_store(addr: str, port: int, timeout: float, multi_tenant: bool = False):
    """A TCPStore server listening on `addr` only (`port` 0: a free one; the store takes the
    socket over, and closes it). `multi_tenant`: later multi-tenant stores of this process on the
    same port share this server (torchrun's agent: `runtime.launch.torchrun`)."""
    from torch.distributed import TCPStore

    sock = listening(addr, port)
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        return TCPStore(addr, port, None, True, timedelta(seconds=timeout), wait_for_workers=False,
                        multi_tenant=multi_tenant, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def open_store(env: RankEnv, timeout: float, host: bool = False, client: bool = False):
    """The rendezvous store: hosted here when `host` (our launcher) or when rank 0 runs without
    an agent — listening on MASTER_ADDR alone, never every interface; otherwise (or as a second
    connection, `client`) a client whose every call waits up to `timeout` for the host to answer."""
    from torch.distributed import TCPStore

    master = not client and (host or (env.rank == 0 and not env.agent_store))
    try:
        if master:
            return bound_store(env.addr, env.port, timeout)
        return TCPStore(env.addr, env.port, None, False, timedelta(seconds=timeout), wait_for_workers=False)
    except (RuntimeError, OSError, ValueError) as e:
        text = str(e).lower()
        if master and ("in use" in text or "eaddrinuse" in text or "bind" in text):
            raise RankError(f"MASTER_PORT {env.port} on {env.addr} is in use; pick another port "
                            f"(--master-port or MASTER_PORT) or stop what holds it") from None
        if master:
            raise RankError(f"cannot host the rendezvous store on {env.addr}:{env.port}: {e}") from None
        raise RankError(f"rank {env.rank} on {socket.gethostname()}: no rendezvous store answered at "
                        f"{env.addr}:{env.port} within "
                        f"{timeout:g} s (is rank 0 or the launcher running, with the same MASTER_ADDR/PORT?)") from None


def first_wins(store, key: str, value: str) -> str:
    """Set `key` unless it is set; the value that holds (the first failure is the one reported)."""
    return store.compare_set(PREFIX + key, "", value).decode(errors="replace")


def read(store, key: str) -> str | None:
    return store.get(PREFIX + key).decode(errors="replace") if store.check([PREFIX + key]) else None


LAUNCHER_LINE = "launcher-line"  # the launcher's line on a dead rank, posted before it aborts with it


def error_key(rank: int) -> str:
    """Where the line naming `rank`'s last error is posted (by the launcher on its death, by the
    rank that saw it fall silent, by the rank itself): what /health's ranks show."""
    return f"error/{rank}"


def phase_of(store, rank: int) -> str:
    """The phase `rank` last started ("start" before its first)."""
    return read(store, f"phase/{rank}") or "start"


class RankStore:
    """A joined rank's store: its sync points, phase and progress, heartbeats, error lines and
    the abort line. Beating, and losing the service, are the process group's side (`ranks.Group`)."""

    def __init__(self, env: RankEnv, store, timeout: float):
        self.env, self.store, self.timeout = env, store, timeout
        self.rank, self.world = env.rank, env.world
        self.lost: str | None = None  # set once the service is lost: every collective and wait fails
        self._beat: Heartbeat | None = None
        self.usage = None  # runtime.usage.Usage once it beats: this rank's CPU, RSS and device
        # the abort line's connection: once beating, the heartbeat's (its calls wait at most the
        # rank timeout), so failing the service never blocks long on a store that is gone
        self._quick = store
        self._members: dict[int, dict[str, Any]] = {}  # rank → what it posted when it joined
        self.errors: dict[int, str] = {}  # rank → the line naming its last error (/health's ranks)
        self.phase = ""
        self.hosts: list[str] = []  # each rank's host, from the joins (rank order)
        self._progress = (0, 0.0, "")  # (posts, when, phase) of this rank's last progress post

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.store.set(f"{PREFIX}phase/{self.rank}", phase)

    def who(self, rank: int | None = None) -> str:
        """`rank 1 on host-b`: how every line names a rank (this one by default)."""
        rank = self.rank if rank is None else rank
        host = self.hosts[rank] if rank < len(self.hosts) else socket.gethostname() if rank == self.rank else ""
        return f"rank {rank} on {host}" if host else f"rank {rank}"

    def leader(self, rank: int | None = None) -> int:
        """The lowest rank on `rank`'s host (this one's by default): it compiles for its host."""
        rank = self.rank if rank is None else rank
        if rank >= len(self.hosts):
            return 0
        return self.hosts.index(self.hosts[rank])

    def progress_sink(self, event) -> None:
        """An emitter sink: this rank's events are its progress, posted where a rank that waits
        for it reads them (throttled; a phase change is posted at once). Waits judge a rank by
        whether this moves, not by a fixed deadline."""
        if event.rank not in (None, self.rank) or event.kind not in ("start", "progress", "log", "end"):
            return
        if HOSTS_DETAIL in event.detail:  # rank 0's word on the other hosts: none of its own progress
            return
        posts, when, phase = self._progress
        now = time.monotonic()
        if event.phase == phase and now - when < PROGRESS_EVERY_S and event.kind != "end":
            return
        counted = event.done is not None and event.total is not None
        post = Progress(posts + 1, event.phase, event.kind, event.done if counted else None,
                        event.total if counted else None, event.unit or "")
        self._progress = (posts + 1, now, event.phase)
        with contextlib.suppress(Exception):  # the store's host gone: the heartbeat says so
            self.store.set(f"{PREFIX}progress/{self.rank}", post.line())

    def progress_of(self, rank: int, store=None) -> tuple[str, Progress | None]:
        """`rank`'s phase and last posted progress (on `store`, another connection, if given)."""
        store = store or self.store
        return phase_of(store, rank), Progress.from_line(read(store, f"progress/{rank}"))

    def watch_hosts(self, update, emit) -> HostsWatch:
        """Rank 0 while it registers: each host's phase and progress, on a connection of its
        own (runtime.launch.progress.HostsWatch); the caller stops it."""
        store = open_store(self.env, self.timeout, client=True)

        def posted(rank: int) -> dict[str, Any]:
            raw = read(store, f"member/{rank}")
            return json.loads(raw) if raw else {}

        return HostsWatch(self.hosts, lambda rank: self.progress_of(rank, store), update, emit, posted).start()

    def abort(self, message: str) -> str:
        """Stop every rank with `message` (unless another failure came first: that one holds)."""
        return first_wins(self._quick, "abort", message)

    def aborted(self) -> str | None:
        return read(self.store, "abort")

    def blame(self, rank: int, line: str, post: bool = True) -> None:
        """`line` is `rank`'s last error: kept here and (`post`) in the store, where rank 0 reads
        it for /health once the service fails (not when the store is what was lost)."""
        self.errors[rank] = line
        if post:
            with contextlib.suppress(Exception):  # the store's host may be gone too
                self._quick.set(PREFIX + error_key(rank), line)

    def read_errors(self) -> None:
        """Every rank's last error posted in the store (the launcher's line on a dead rank, a
        peer's on a silent one), into `errors`; only once the service fails, so a healthy
        /health costs no store round trip."""
        for r in range(self.world):
            line = read(self._quick, error_key(r))
            if line:
                self.errors.setdefault(r, line)

    def said_by_launcher(self, reason: str) -> bool:
        """Whether `reason` is the launcher's own line on a dead rank (it is in the events already)."""
        try:
            return read(self._quick, LAUNCHER_LINE) == reason
        except Exception:  # the store is gone with its host: nobody said it
            return False

    def post(self, key: str, value: str = "") -> None:
        """This rank reached `key` (with `value`): what `wait` and `gather` wait for."""
        self.store.set(f"{PREFIX}{key}/{self.rank}", value)

    def gather(self, key: str, value: str, what: str, timeout: float | None = None, *, ranks=None,
               stall: float | None = None, shown: Callable[[str], None] | None = None) -> list[str]:
        """Every rank's (or `ranks`') `value` for `key`, in rank order, once all have posted it.
        Raises at once with the reason when a rank aborted; otherwise see `wait`."""
        self.post(key, value)
        return self.wait(key, range(self.world) if ranks is None else ranks, what, timeout, stall=stall, shown=shown)

    def wait(self, key: str, ranks, what: str, timeout: float | None = None, *, stall: float | None = None,
             shown: Callable[[str], None] | None = None) -> list[str]:
        """The values `ranks` posted for `key`. Without `stall`: they must arrive within `timeout`
        (the rendezvous). With `stall`: a rank is waited for as long as it is alive (its
        heartbeat) and its progress moves; one whose progress stood still for `stall` seconds is
        named with its host and phase. `shown` hears what the awaited ranks are doing, now and then."""
        ranks = list(ranks)
        keys = [f"{PREFIX}{key}/{r}" for r in ranks]
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        waiting = _Waiting(self, stall, shown) if stall is not None else None
        while not self.store.check(keys):
            if self.lost is not None:
                raise RankError(self.lost)
            if reason := self.aborted():
                raise RankError(f"stopped: {reason}")
            if waiting is not None:
                if problem := waiting.stalled(lambda: self._missing(ranks, keys)):
                    raise RankError(f"{what}: {problem}")
            elif time.monotonic() > deadline:
                missing = ", ".join(map(str, self._missing(ranks, keys)))
                raise RankError(f"{what}: rank {missing} did not arrive within {limit:g} s")
            time.sleep(POLL_S)
        return [self.store.get(k).decode() for k in keys]

    def post_phase_seconds(self, records: dict[str, dict[str, Any]]) -> None:
        """This rank registered: each phase's seconds, for rank 0's launch record (`phase_seconds`)."""
        self.post(PHASE_SECONDS, json.dumps({p: r.get("seconds") for p, r in records.items()}))

    def phase_seconds(self, timeout: float = PHASE_SECONDS_WAIT_S) -> dict[int, dict[str, Any]]:
        """Each rank's phase seconds as it posted them, waiting at most `timeout` for all of them (a
        rank that has not posted by then is left out): a figure, never a sync point."""
        keys = {r: f"{PREFIX}{PHASE_SECONDS}/{r}" for r in range(self.world)}
        deadline = time.monotonic() + timeout
        while not self.store.check(list(keys.values())) and time.monotonic() < deadline and self.lost is None:
            time.sleep(POLL_S)
        out = {}
        for r, k in keys.items():
            with contextlib.suppress(ValueError, TypeError):
                if self.store.check([k]):
                    out[r] = dict(json.loads(self.store.get(k).decode(errors="replace")))
        return out

    def _missing(self, ranks: list[int], keys: list[str]) -> list[int]:
        return [r for r, k in zip(ranks, keys, strict=True) if not self.store.check([k])]

    def watch(self, on_abort: Callable[[str], None]) -> None:
        """Call `on_abort(reason)` (once, on a daemon thread) when any rank or the launcher aborts."""
        def run() -> None:
            try:
                while (reason := self.aborted()) is None and self.lost is None:
                    time.sleep(0.2)
            except Exception as e:  # the store's host is gone
                reason = f"{self.who()} lost the rendezvous store ({first_line(e)})"
                self.blame(self.rank, reason, post=False)
            else:
                with contextlib.suppress(Exception):  # the rank the abort is about, for /health
                    self.read_errors()
            on_abort(reason or self.lost)

        threading.Thread(target=run, daemon=True, name="rank-watch").start()

    def members(self) -> list[dict[str, Any]]:
        """Every rank as rank 0 knows it (runtime.launch.liveness.roster)."""
        def posted(r: int) -> str | None:
            return read(self.store, f"member/{r}")

        usage = dict(self._beat.usage) if self._beat is not None else {}
        if self.usage is not None:
            usage[self.rank] = self.usage.read()
        return roster(self.world, self.rank, self.phase, self._members, posted,
                      self._beat.ages() if self._beat is not None else {}, self.errors, usage)


class _Waiting:
    """A wait's view of the ranks it waits for: when each one's progress last moved, and what it
    is doing (read from the store at most every PROGRESS_EVERY_S)."""

    def __init__(self, group: RankStore, stall: float, shown: Callable[[str], None] | None):
        self.group, self.stall, self.shown = group, stall, shown
        self.seen: dict[int, tuple[str | None, float]] = {}
        self.read_at = 0.0
        self.shown_at = time.monotonic()

    def stalled(self, missing: Callable[[], list[int]]) -> str | None:
        now = time.monotonic()
        if now - self.read_at < PROGRESS_EVERY_S:
            return None
        self.read_at = now
        doing = []
        for r in missing():
            text = read(self.group.store, f"progress/{r}")
            before = self.seen.get(r)
            if before is None or before[0] != text:
                self.seen[r] = before = (text, now)
            progress = Progress.from_line(text)
            what = progress.doing if progress is not None else phase_of(self.group.store, r)
            if now - before[1] > self.stall:
                return (f"{self.group.who(r)} made no progress for {self.stall:g} s (--stall-timeout) while "
                        f"the others waited for it; its last: {what}")
            doing.append(f"{self.group.who(r)}: {what}")
        if self.shown is not None and doing and now - self.shown_at >= SHOW_WAIT_EVERY_S:
            self.shown_at = now
            self.shown("waiting for " + "; ".join(doing))
        return None
