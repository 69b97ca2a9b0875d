"""Rank processes of one service: who this process is, the rendezvous, and the per-step link.

A service of N ranks is N processes (one per device), started by `dsv4 serve --ranks N` (its
launcher, `runtime.serve.rank_launcher`) or by `torchrun` (`--nnodes 2 …` across hosts): each reads
RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Two channels:

- the **rendezvous store** (`runtime.launch.rank_store`: a TCPStore that torchrun's agent or
  our launcher hosts, else rank 0): joining and comparing plan fingerprints, sync points of registration,
  each rank's phase, every rank's heartbeat (`runtime.launch.liveness`: a rank silent for --rank-timeout is lost)
  and one `abort` line that every rank watches — a failure anywhere stops every rank promptly,
  with the reason, instead of leaving them blocked on a peer that is gone;
- the **process group** (gloo on cpu, nccl on cuda, hccl on npu): rank 0 broadcasts each engine
  call (`lead`) and every rank runs it: each its own sequences' attention; the routed experts'
  rows are exchanged all-to-all (`runtime.engine.dispatch`). Every collective is waited for in
  slices, and fails as soon as the service is lost: none waits on a peer that is gone.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from runtime.launch.agree import Join, disagreement
from runtime.launch.liveness import Heartbeat, first_line, member
from runtime.launch.rank_store import (
    POLL_S,
    PREFIX,
    RankEnv,
    RankError,
    RankStore,
    open_store,
    own_address,
)

# the process group's own backstop: a collective fails after this long whatever the heartbeats
# say (an idle service pings well within it); a lost rank fails it within one wait slice
COLLECTIVE_TIMEOUT_S = 120.0
WAIT_SLICE = timedelta(seconds=0.1)
PING_EVERY_S = 5.0
LOSE_WAIT_S = 10.0  # a second failure waits this long for the first to have failed the service
LAUNCHER_GRACE_S = 1.0  # a failed collective waits this long for the launcher's line on a dead rank
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
BOUND_GLOO = "dsv4-gloo"  # gloo whose sockets listen on one address (`bound_backend`)


def bound_backend(device_kind: str, address: str) -> str:
    """The process group's backend, listening on `address` (this host's on the master's
    network) and no other: gloo's device is made for that address (left to itself it takes the
    host name's, whatever network that is on); nccl and hccl are told by their own variables
    (NCCL_SOCKET_IFNAME: the interface holding the address; HCCL_IF_IP), unless the operator set
    them."""
    import torch.distributed as dist

    backend = BACKENDS[device_kind]
    if backend == "nccl":
        if interface := _interface_of(address):
            os.environ.setdefault("NCCL_SOCKET_IFNAME", f"={interface}")
        return backend
    if backend == "hccl":
        os.environ.setdefault("HCCL_IF_IP", address)
        return backend

    def gloo(store, rank: int, size: int, timeout: timedelta):
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(store, rank, size, options)

    if BOUND_GLOO not in dist.Backend.backend_list:
        dist.Backend.register_backend(BOUND_GLOO, gloo, devices=["cpu"])
    return BOUND_GLOO


def _interface_of(address: str) -> str | None:
    import psutil

    return next((name for name, addrs in psutil.net_if_addrs().items() if any(a.address == address for a in addrs)),
                None)


class Group(RankStore):
    """A joined rank: the store's side (`RankStore`), and the engine's link to the other ranks
    (rank 0 leads: every engine call is broadcast first; others follow; each layer's routed rows
    are exchanged)."""

    def __init__(self, env: RankEnv, store, timeout: float):
        super().__init__(env, store, timeout)
        self._pg = False
        self._last_sent = time.monotonic()
        # called once when a collective fails (a peer died or hung): the service fails closed
        self.on_lost: Callable[[str], None] = lambda reason: None
        self._losing = threading.Lock()
        self._told = threading.Event()  # set once `on_lost` was told (the service answers 503 by then)
        self._reason: str | None = None
        self._kind = "cpu"
        self.exchange_s = 0.0  # seconds spent in the steps' all-to-alls (the bench's collective time)
        self._subgroups: dict[tuple[int, ...], Any] = {}

    # ---- the process group ----

    def connect(self, device_kind: str) -> None:
        import torch
        import torch.distributed as dist

        if device_kind != "cpu":  # nccl/hccl address the current device: this rank's
            getattr(torch, device_kind).set_device(self.env.local_rank)
        self._kind = device_kind

        dist.init_process_group(bound_backend(device_kind, own_address(self.env.addr)),
                                store=dist.PrefixStore(PREFIX + "pg", self.store), rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
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

    def beat(self, rank_timeout: float, device: str = "") -> None:
        """Beat in the store and watch every other rank's beat (runtime.launch.liveness), on a
        connection of its own whose calls wait at most `rank_timeout`: a rank silent that long,
        or a store that stops answering, loses the service."""
        from runtime.log import current
        from runtime.usage import Usage

        self.usage = Usage(device)  # this rank's CPU, RSS and device, posted with each beat
        self.store.set(f"{PREFIX}member/{self.rank}", member(self.rank, device, str(current().path or "")))
        store = open_store(self.env, rank_timeout, client=True)
        peers = [r for r in range(self.world) if r != self.rank]
        self._quick = store
        self._beat = Heartbeat(store, PREFIX, self.rank, peers, rank_timeout, self.lose, self.blame,
                               self.usage.line).start()

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
