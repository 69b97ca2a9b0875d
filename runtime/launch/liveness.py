"""Every rank's heartbeat in the rendezvous store, and each rank's watch over the others'.

Across hosts only a collective notices a peer that vanished (power, network, the OOM killer,
preemption, SIGSTOP), and the request riding on it pays for the discovery. So each rank beats
(a counter it bumps every `rank_timeout / 5` s) on a store connection of its own, with the
rank timeout as its deadline, and reads the others' beats on the same pass. A rank whose
counter has not moved for `rank_timeout` seconds, as measured here, is lost, whether or not
traffic flows; so is the store when it stops answering (its host is gone). Beats are compared
by change, never by clock, so hosts need no common time, and a pass that ran late (this process
starved) reads fresh counters before it judges anyone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable

BEATS_PER_TIMEOUT = 5
MIN_BEAT_S = 0.05


def member(rank: int, device: str = "", log: str = "") -> str:
    """What a rank posts about itself when it joins: where to look for it, and its log file."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "rank": rank, "device": device, "log": log})


def roster(world: int, me: int, my_phase: str, known: dict[int, dict], posted: Callable[[int], str | None],
           ages: dict[int, tuple[float, str | None]], errors: dict[int, str] | None = None,
           usage: dict[int, dict] | None = None) -> list[dict]:
    """Every rank: host, pid, device and log (what it posted when it joined, read once into
    `known`), its phase, the seconds since its heartbeat last moved (`me`: 0, and its own phase),
    its last error (`errors`: the line that named it, e.g. the launcher's on its death) and what
    it uses (`usage`: CPU, RSS, device, as its heartbeat last posted them)."""
    if len(known) < world:
        with contextlib.suppress(Exception):  # a store gone: what is known so far
            for r in range(world):
                if r not in known and (raw := posted(r)):
                    known[r] = json.loads(raw)
    out = []
    for r in range(world):
        m = known.get(r, {})
        age, phase = (0.0, my_phase) if r == me else ages.get(r, (None, None))
        out.append({"rank": r, "host": m.get("host", ""), "pid": m.get("pid"), "device": m.get("device", ""),
                    "phase": phase or "", "heartbeat_age": None if age is None else round(age, 2),
                    "error": (errors or {}).get(r, ""), "log": m.get("log", ""), **(usage or {}).get(r, {})})
    return out


def describe(rank: int, posted: str | None) -> str:
    """`rank 1 on host-b (pid 4242)`, from what the rank posted when it joined."""
    try:
        m = json.loads(posted or "")
        return f"rank {rank} on {m['host']} (pid {m['pid']})"
    except (ValueError, TypeError, KeyError):
        return f"rank {rank}"


class Heartbeat:
    """Beat for `rank`, watch `peers`; `lose(reason)` once when one goes silent or the store
    stops answering, after `blame(rank, reason, post)` names the rank the reason is about (the
    silent one, or this one when it lost the store: nothing to post to then). `store` is this
    watch's own connection (its timeout: the rank timeout). `usage()`: what this rank uses (JSON,
    runtime.usage), posted with each beat; the peers' are read on the same pass (`usage`)."""

    def __init__(self, store, prefix: str, rank: int, peers: list[int], rank_timeout: float,
                 lose: Callable[[str], None], blame: Callable[[int, str, bool], None] | None = None,
                 usage: Callable[[], str] | None = None):
        self.store, self.prefix, self.rank, self.peers = store, prefix, rank, peers
        self.rank_timeout, self.lose, self.posts_usage = rank_timeout, lose, usage
        self.usage: dict[int, dict] = {}  # each rank's last posted use (this one's included)
        self.blame = blame or (lambda rank, reason, post: None)
        self.every = max(MIN_BEAT_S, rank_timeout / BEATS_PER_TIMEOUT)
        self._stop = threading.Event()
        # peer → (when its beat last moved, its phase then), monotonic: what /health's ranks show
        self.heard: dict[int, tuple[float, str | None]] = {}

    def start(self) -> Heartbeat:
        threading.Thread(target=self._run, daemon=True, name="rank-heartbeat").start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _key(self, what: str, rank: int) -> str:
        return f"{self.prefix}{what}/{rank}"

    def _run(self) -> None:
        beat = 0
        now = time.monotonic()
        heard = {r: (None, now) for r in self.peers}  # peer → (its last counter, when it last moved)
        while not self._stop.is_set():
            try:
                beat += 1
                self.store.set(self._key("beat", self.rank), str(beat))
                if self.posts_usage is not None:
                    self.store.set(self._key("usage", self.rank), self.posts_usage())
                now = time.monotonic()
                for r, (last, since) in heard.items():
                    value = self._read("beat", r)
                    if value != last:
                        heard[r] = (value, now)
                        self.heard[r] = (now, self._read("phase", r))
                        self._read_usage(r)
                    elif now - since > self.rank_timeout:
                        reason = self._silent(r, now - since)
                        self.blame(r, reason, True)
                        self.lose(reason)
                        return
            except Exception as e:  # the store's host is gone, or it stopped answering
                if not self._stop.is_set():
                    reason = (f"rank {self.rank} on {socket.gethostname()} lost the rendezvous store (its host "
                              f"is gone or stopped answering within {self.rank_timeout:g} s: {first_line(e)})")
                    self.blame(self.rank, reason, False)
                    self.lose(reason)
                return
            self._stop.wait(self.every)

    def ages(self) -> dict[int, tuple[float, str | None]]:
        """Each peer heard from: (seconds since its beat last moved, its phase then)."""
        now = time.monotonic()
        return {r: (now - at, phase) for r, (at, phase) in dict(self.heard).items()}

    def _read(self, what: str, rank: int) -> str | None:
        key = self._key(what, rank)
        return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None

    def _read_usage(self, rank: int) -> None:
        with contextlib.suppress(ValueError, TypeError):
            posted = json.loads(self._read("usage", rank) or "null")
            if isinstance(posted, dict):
                self.usage[rank] = posted

    def _silent(self, rank: int, seconds: float) -> str:
        posted = phase = None
        with contextlib.suppress(Exception):
            posted, phase = self._read("member", rank), self._read("phase", rank)
        return (f"{describe(rank, posted)} stopped answering: no heartbeat for {seconds:.1f} s "
                f"(--rank-timeout {self.rank_timeout:g}) during phase {phase or 'start'}")


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
