"""Rank processes of one service: who this process is, the rendezvous, and the per-step link.

A service of N ranks is N processes (one per device), started by `dsv4 serve --ranks N` (its
launcher, `runtime.serve.rank_launcher`) or by `torchrun` (`--nnodes 2 …` across hosts): each reads
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Two channels:

- the **rendezvous store** (a TCPStore: torchrun's agent or our launcher hosts it, else rank
  0): joining and comparing plan fingerprints, sync points of registration, each rank's phase,
  every rank's heartbeat (`runtime.launch.liveness`: a rank silent for --rank-timeout is lost)
  and one `abort` line that every rank watches — a failure anywhere stops every rank promptly,
  with the reason, instead of leaving them blocked on a peer that is gone;
- the **process group** (gloo on cpu, nccl on cuda, hccl on npu): rank 0 broadcasts each engine
  call (`lead`) and every rank runs it: each its own sequences' attention; the routed experts'
  rows are exchanged all-to-all (`runtime.serve.dispatch`). Every collective is waited for in
  slices, and fails as soon as the service is lost: none waits on a peer that is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from runtime.launch.agree import Join, disagreement
from runtime.launch.liveness import Heartbeat, first_line, member, roster
from runtime.launch.progress import HOSTS_DETAIL, HostsWatch, Progress
from store.errors import UserError

PREFIX = "dsv4/"
# the process group's own backstop: a collective fails after this long whatever the heartbeats
# say (an idle service pings well within it); a lost rank fails it within one wait slice
COLLECTIVE_TIMEOUT_S = 120.0
WAIT_SLICE = timedelta(seconds=0.1)
PING_EVERY_S = 5.0
POLL_S = 0.05
LOSE_WAIT_S = 10.0  # a second failure waits this long for the first to have failed the service
LAUNCHER_GRACE_S = 1.0  # a failed collective waits this long for the launcher's line on a dead rank
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
PROGRESS_EVERY_S = 0.5  # a rank posts its progress at most this often; a waiter reads it as often
SHOW_WAIT_EVERY_S = 5.0  # a waiting rank says whom it waits for, and what they do, this often


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


def open_store(env: RankEnv, timeout: float, host: bool = False, client: bool = False):
    """The rendezvous store: hosted here when `host` (our launcher) or when rank 0 runs without
    an agent; otherwise (or as a second connection, `client`) a client whose every call waits
    up to `timeout` for the host to answer."""
    from torch.distributed import TCPStore

    master = not client and (host or (env.rank == 0 and not env.agent_store))
    try:
        return TCPStore(env.addr, env.port, None, master, timedelta(seconds=timeout), wait_for_workers=False)
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


class Group:
    """A joined rank: the store's sync points and abort line, and the engine's link to the
    other ranks (rank 0 leads: every engine call is broadcast first; others follow; each
    layer's routed rows are exchanged)."""

    def __init__(self, env: RankEnv, store, timeout: float):
        self.env, self.store, self.timeout = env, store, timeout
        self.rank, self.world = env.rank, env.world
        self._pg = False
        self._last_sent = time.monotonic()
        # called once when a collective fails (a peer died or hung): the service fails closed
        self.on_lost: Callable[[str], None] = lambda reason: None
        self.lost: str | None = None  # set once the service is lost: every collective and wait fails
        self._losing = threading.Lock()
        self._told = threading.Event()  # set once `on_lost` was told (the service answers 503 by then)
        self._reason: str | None = None
        self._beat: Heartbeat | None = None
        # the abort line's connection: once beating, the heartbeat's (its calls wait at most the
        # rank timeout), so failing the service never blocks long on a store that is gone
        self._quick = store
        self._kind = "cpu"
        self.exchange_s = 0.0  # seconds spent in the steps' all-to-alls (the bench's collective time)
        self._members: dict[int, dict[str, Any]] = {}  # rank → what it posted when it joined
        self.errors: dict[int, str] = {}  # rank → the line naming its last error (/health's ranks)
        self.phase = ""
        self.hosts: list[str] = []  # each rank's host, from the joins (rank order)
        self._progress = (0, 0.0, "")  # (posts, when, phase) of this rank's last progress post
        self._subgroups: dict[tuple[int, ...], Any] = {}

    # ---- the store ----

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

    def _missing(self, ranks: list[int], keys: list[str]) -> list[int]:
        return [r for r, k in zip(ranks, keys, strict=True) if not self.store.check([k])]

    def beat(self, rank_timeout: float, device: str = "") -> None:
        """Beat in the store and watch every other rank's beat (runtime.launch.liveness), on a
        connection of its own whose calls wait at most `rank_timeout`: a rank silent that long,
        or a store that stops answering, loses the service."""
        self.store.set(f"{PREFIX}member/{self.rank}", member(self.rank, device))
        store = open_store(self.env, rank_timeout, client=True)
        peers = [r for r in range(self.world) if r != self.rank]
        self._quick = store
        self._beat = Heartbeat(store, PREFIX, self.rank, peers, rank_timeout, self.lose, self.blame).start()

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

        return roster(self.world, self.rank, self.phase, self._members, posted,
                      self._beat.ages() if self._beat is not None else {}, self.errors)

    # ---- the process group ----

    def connect(self, device_kind: str) -> None:
        import torch
        import torch.distributed as dist

        if device_kind != "cpu":  # nccl/hccl address the current device: this rank's
            getattr(torch, device_kind).set_device(self.env.local_rank)
        self._kind = device_kind

        dist.init_process_group(BACKENDS[device_kind], store=dist.PrefixStore(PREFIX + "pg", self.store),
                                rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self._pg = True

    def lead(self, op: str, *args: Any) -> None:
        """Rank 0: send an engine call to every other rank (they run it in `follow`); elsewhere a
        no-op, because there the call came from `follow`."""
        if self.rank == 0 and self.world > 1:
            self._broadcast([op, args])
            self._last_sent = time.monotonic()

    def ping(self) -> None:
        """Rank 0, idle: a no-op call, so followers' receives never time out on a quiet service."""
        if time.monotonic() - self._last_sent > PING_EVERY_S:
            with contextlib.suppress(RankError):  # `on_lost` has failed the service already
                self.lead("ping")

    def receive(self) -> tuple[str, tuple]:
        op, args = self._broadcast(None)
        return op, tuple(args)

    def _broadcast(self, message: Any) -> Any:
        """Rank 0's `message` (an engine call: names, numbers, lists, tensors) on every rank.
        Encoded with torch.save and read back with `weights_only=True`, so a message can carry
        data, never code."""
        import io

        import torch

        if self.rank == 0:
            buf = io.BytesIO()
            torch.save(_to_host(message), buf)
            self.share_bytes(buf.getvalue(), 0)
            return message
        payload = io.BytesIO(self.share_bytes(None, 0))
        return torch.load(payload, weights_only=True)

    def share_bytes(self, data: bytes | None, src: int, ranks: list[int] | None = None) -> bytes:
        """`src`'s `data` on every rank of `ranks` (default: all; each of them calls this, in the
        same order): its size, then its bytes, each an interruptible collective."""
        import torch
        import torch.distributed as dist

        device = "cpu" if self._kind == "cpu" else f"{self._kind}:{self.env.local_rank}"
        group = self._subgroup(ranks)
        try:
            if self.rank == src:
                payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
                           else torch.empty(0, dtype=torch.uint8)).to(device)
                size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
            else:
                size = torch.zeros(1, dtype=torch.int64, device=device)
            self._finish(dist.broadcast(size, src, group=group, async_op=True))
            if self.rank != src:
                payload = torch.empty(int(size), dtype=torch.uint8, device=device)
            if payload.numel():
                self._finish(dist.broadcast(payload, src, group=group, async_op=True))
        except RankError:
            raise
        except Exception as e:  # a peer that died or hung: the group is gone
            raise self._lose(e) from None
        return data if self.rank == src and data is not None else payload.cpu().numpy().tobytes()

    def _subgroup(self, ranks: list[int] | None):
        """The process group of `ranks` (None: the whole service), made once; only its members
        take part in making it, so the others go on with their phases."""
        if ranks is None or len(ranks) == self.world:
            return None
        key = tuple(sorted(ranks))
        if key not in self._subgroups:
            import torch.distributed as dist

            self._subgroups[key] = dist.new_group(list(key), use_local_synchronization=True)
        return self._subgroups[key]

    def _finish(self, work) -> None:
        """Wait for an async collective in slices; once the service is lost it fails at once
        instead of waiting on a peer that is gone (gloo cannot abort a collective: the work is
        left behind in a process that is about to exit)."""
        while True:
            if self.lost is not None:
                raise RankError(self.lost)
            if self._kind != "cpu":  # nccl/hccl: wait() only orders streams; poll for completion
                if work.is_completed():
                    work.wait()
                    return
                time.sleep(0.0002)
                continue
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError as e:
                if "timed out" not in str(e).lower():
                    raise

    def exchange(self, send, counts: list[int], recv_counts: list[int] | None = None):
        """All-to-all of rows: `send` holds counts[q] rows for each rank q, rank-major. Returns
        (the rows every rank sent here, rank-major; how many from each). With `recv_counts`
        known, the counts are not exchanged first."""
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        try:
            if recv_counts is None:
                mine = torch.tensor(counts, dtype=torch.int64, device=send.device)
                theirs = torch.empty_like(mine)
                self._finish(dist.all_to_all_single(theirs, mine, async_op=True))
                recv_counts = theirs.tolist()
            got = send.new_empty((sum(recv_counts), *send.shape[1:]))
            self._finish(dist.all_to_all_single(got, send.contiguous(), recv_counts, counts, async_op=True))
        except RankError:
            raise
        except Exception as e:  # a peer that died or hung: the group is gone
            raise self._lose(e) from None
        finally:
            self.exchange_s += time.perf_counter() - t0
        return got, recv_counts

    def lose(self, reason: str) -> str:
        """The service is lost (a rank silent, a collective failed): say so once, to every rank
        (a reason posted first, e.g. the launcher's line on a dead rank, holds), tell `on_lost`
        (rank 0: the service fails closed, 503 with it), then fail every collective and wait."""
        with self._losing:
            first = self._reason is None
            if first:
                self._reason = reason
        if not first:  # another thread is failing the service: fail only once it has (503s first)
            self._told.wait(LOSE_WAIT_S)
            return self.lost or self._reason
        with contextlib.suppress(Exception):  # the store's host may be gone too
            self._reason = reason = self.abort(reason)
            self.read_errors()  # the store answered: the rank a reason posted first is about
        if self._beat is not None:
            self._beat.stop()
        try:
            self.on_lost(reason)
        finally:
            self.lost = reason
            self._told.set()
        return reason

    def _lose(self, e: BaseException) -> RankError:
        """A failed collective: the group is gone for good."""
        if self.lost is None and self._reason is None:
            line = f"{self.who()} lost the other ranks in a collective ({first_line(e)})"
            # the launcher names a dead rank and its phase a moment later, the heartbeats name a
            # silent one and its host within the rank timeout: either line is better
            wait = LAUNCHER_GRACE_S + (self._beat.rank_timeout if self._beat is not None else 0.0)
            deadline = time.monotonic() + wait
            named, store_answers = False, False
            with contextlib.suppress(Exception):  # the store's host may be gone too
                while self._reason is None and self.aborted() is None and time.monotonic() < deadline:
                    time.sleep(POLL_S)
                named, store_answers = self.aborted() is not None, True
            if self._reason is None and not named:  # nobody named a cause: this rank's own error
                self.blame(self.rank, line, post=store_answers)
            self.lose(line)
        return RankError(self.lost or self._reason)

    def stop(self) -> None:
        """Rank 0: tell the other ranks the service is over (not after the group broke)."""
        if self._beat is not None:
            self._beat.stop()  # the others see rank 0's beat stop only once they were told
        if self.lost is None:
            with contextlib.suppress(RankError):
                self.lead("stop")

    def close(self) -> None:
        if self._pg and self.lost is None:  # a broken group's teardown can wait on the dead peer
            import torch.distributed as dist

            self._pg = False
            with contextlib.suppress(Exception):  # a group that broke cannot be torn down cleanly
                dist.destroy_process_group()


class _Waiting:
    """A wait's view of the ranks it waits for: when each one's progress last moved, and what it
    is doing (read from the store at most every PROGRESS_EVERY_S)."""

    def __init__(self, group: Group, stall: float, shown: Callable[[str], None] | None):
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


def _to_host(message: Any) -> Any:
    """Tuples as lists (what a weights-only load gives back anyway), tensors on the host."""
    if isinstance(message, list | tuple):
        return [_to_host(m) for m in message]
    if hasattr(message, "cpu") and hasattr(message, "dtype"):
        return message.cpu()
    return message


def share_cores(env: RankEnv) -> None:
    """The ranks of one host split its cores: torch's intra-op threads of N ranks each using
    every core spin against each other (one decode step took 10× as long with 2 ranks)."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // env.local_world))


def rendezvous(env: RankEnv, join: Join, timeout: float, device_kind: str, rank_timeout: float = 5.0) -> Group:
    """Join the service: every rank posts its `join` (runtime.launch.agree: its plan's parts, the
    checkpoint by content, its host); a rank missing after `timeout` is named, a rank whose plan
    differs from rank 0's is named with its host and the differing part (for the checkpoint:
    the shard). Then every rank beats (a rank silent for `rank_timeout` is lost) and the process
    group connects."""
    share_cores(env)
    group = Group(env, open_store(env, timeout), timeout)
    group.set_phase("check")
    joined = group.gather("join", join.line(), "rendezvous")
    if problem := disagreement(joined):
        raise RankError(problem)
    group.hosts = [Join.from_line(line).host for line in joined]
    group.beat(rank_timeout, device_kind if device_kind == "cpu" else f"{device_kind}:{env.local_rank}")
    group.connect(device_kind)
    return group


def follow(engine, group: Group, until: str) -> None:
    """A follower rank: run every engine call rank 0 leads, until it sends `until`."""
    while True:
        op, args = group.receive()
        if op == until:
            return
        if op == "ping":
            continue
        if op == "stop":
            raise RankError(f"{group.who()}: rank 0 stopped the service while this rank waited for {until}")
        getattr(engine, op)(*args)
