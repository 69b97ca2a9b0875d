"""The KV budget: how many sequence slots a launch takes on each device and rank (torch-free).

    budget = (total × utilization − used) / ranks sharing that memory
    fits   = budget // slot bytes            (what the memory holds)
    slots  = min(fits, --max-slots)          (what the launch takes)

One function for the plan (`dsv4 plan`, the console's Registration pane), the Device pane and
registration's kv phase, which measures its own device and applies the same rule. Each rank
holds only its own sequences' KV, so a service's slots are the sum of its ranks'. On cuda/npu
rank r of a host owns device r (LOCAL_RANK); on cpu `--device-memory SIZE` is each rank's own
simulated device, and without it the ranks of one host share its memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from store.units import format_size


@dataclass(frozen=True)
class Memory:
    """One device's memory as read (host memory on cpu, optionally capped by --device-memory)."""

    total: int
    free: int
    used: int
    name: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"total": self.total, "free": self.free, "used": self.used}

    def capped(self, cap: int | None, kind: str, allocated: int = 0) -> Memory:
        """As `--device-memory cap` shows it. On cpu the cap *is* the device: total = cap, free =
        what the cap leaves of available host memory, less what this process placed itself; an
        accelerator's cap only lowers its real total (its free memory already counts ours)."""
        if cap is None:
            return self
        if kind == "cpu":
            free = max(0, min(cap - allocated, self.free))
            return Memory(cap, free, cap - free, self.name)
        total = min(self.total, cap)
        free = min(self.free, total)
        return Memory(total, free, total - free, self.name)


@dataclass(frozen=True)
class KvBudget:
    """One rank's KV budget on its device."""

    memory: Memory
    utilization: float
    slot_bytes: int
    max_slots: int
    share: int = 1  # ranks whose KV this memory holds (cpu: the host's ranks)
    rank: int = 0

    @property
    def budget(self) -> int:
        return (int(self.memory.total * self.utilization) - self.memory.used) // max(1, self.share)

    @property
    def fits(self) -> int:
        """Slots the budget holds, without the --max-slots cap."""
        return max(0, self.budget // self.slot_bytes) if self.slot_bytes > 0 else 0

    @property
    def slots(self) -> int:
        """Slots the launch takes: what fits, at most --max-slots."""
        return min(self.max_slots, self.fits)

    @property
    def capped(self) -> bool:
        return self.fits > self.max_slots

    @property
    def problem(self) -> str:
        if self.slots >= 1:
            return ""
        if self.budget <= 0:
            return (f"residual usage leaves no KV budget: total {format_size(self.memory.total)} × "
                    f"{self.utilization} − used {format_size(self.memory.used)} ≤ 0")
        return (f"not even one KV slot fits: a slot needs {format_size(self.slot_bytes)}, the budget is "
                f"{format_size(self.budget)} (total × {self.utilization} − used"
                + (f", / {self.share} ranks" if self.share > 1 else "") + ")")

    def to_json(self) -> dict[str, Any]:
        return {**self.memory.to_json(), "device": self.memory.name, "rank": self.rank,
                "utilization": self.utilization, "budget": self.budget, "slot_bytes": self.slot_bytes,
                "fits": self.fits, "slots": self.slots, "max_slots": self.max_slots, "share": self.share,
                "problem": self.problem}


def kv_budget(memory: Memory, slot_bytes: int, utilization: float, max_slots: int, share: int = 1,
              rank: int = 0) -> KvBudget:
    return KvBudget(memory, utilization, slot_bytes, max_slots, max(1, share), rank)


def kv_share(kind: str, local_ranks: int, device_memory: int | None) -> int:
    """How many ranks' KV one rank's memory reading holds: a host's ranks split its memory on
    cpu, unless --device-memory gives each its own simulated device; one on an accelerator."""
    return local_ranks if kind == "cpu" and device_memory is None else 1


def rank_budgets(kind: str, devices: Sequence[Memory], ranks: int, slot_bytes: int, utilization: float,
                 max_slots: int, device_memory: int | None = None) -> list[KvBudget]:
    """Every rank's budget on one host: on cpu each rank sizes `devices[0]` (host memory split
    among the ranks, or the --device-memory device each has); on an accelerator rank r sizes
    device r's memory (a rank without a device has no entry)."""
    if kind == "cpu":
        share = kv_share(kind, ranks, device_memory)
        return [kv_budget(devices[0], slot_bytes, utilization, max_slots, share, r) for r in range(ranks)]
    return [kv_budget(devices[r], slot_bytes, utilization, max_slots, 1, r) for r in range(min(ranks, len(devices)))]


@dataclass(frozen=True)
class LaunchKv:
    """What a launch's KV phase will take: each rank's budget and slots; the service's slots
    are their sum (each rank holds its own sequences' KV)."""

    kind: str
    ranks: int
    per_rank: tuple[KvBudget, ...]
    slot_bytes: int
    max_seq: int
    missing: str = ""  # ranks without a device of their own, in words

    @property
    def slots(self) -> int:
        return sum(b.slots for b in self.per_rank)

    @property
    def fits(self) -> int:
        return sum(b.fits for b in self.per_rank)

    @property
    def problem(self) -> str:
        if self.missing:
            return self.missing
        worst = min(self.per_rank, key=lambda b: b.slots, default=None)
        if worst is None or not worst.problem:
            return ""
        return f"rank {worst.rank}: {worst.problem}" if self.ranks > 1 else worst.problem

    def to_json(self) -> dict[str, Any]:
        first = self.per_rank[0].to_json() if self.per_rank else {}
        return {**{k: first.get(k) for k in ("total", "free", "used", "utilization", "budget", "max_slots")},
                "slot_bytes": self.slot_bytes, "fits": self.fits, "slots": self.slots, "max_seq": self.max_seq,
                "ranks": self.ranks, "per_rank": [b.to_json() for b in self.per_rank],
                **({"problem": self.problem} if self.problem else {})}


def launch_kv(kind: str, devices: Sequence[Memory], ranks: int, slot_bytes: int, utilization: float,
              max_slots: int, max_seq: int, device_memory: int | None = None) -> LaunchKv:
    per_rank = tuple(rank_budgets(kind, devices, ranks, slot_bytes, utilization, max_slots, device_memory))
    missing = ""
    if kind != "cpu" and ranks > len(devices):
        missing = f"{ranks} ranks need one {kind} device each, {len(devices)} found"
    return LaunchKv(kind, ranks, per_rank, slot_bytes, max_seq, missing)

