"""Host and device collectors: CPU, load, memory, page cache, disk rates (psutil) and device
memory with every rank's KV budget (`runtime.launch.hardware` reads meminfo, NVML or `npu-smi`;
`runtime.launch.budget` sizes it; never a device context, never torch)."""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import psutil

from runtime.launch.plan_report import RankKv

HISTORY_POINTS = 60  # sparkline length: two minutes at the default interval


@dataclass(frozen=True, kw_only=True)
class HostSnapshot:
    cpu_percent: float = 0.0
    per_core: tuple[float, ...] = ()
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    mem_total: int = 0
    mem_available: int = 0
    page_cache: int = 0
    disk_read_bps: float = 0.0
    disk_write_bps: float = 0.0
    history: Mapping[str, tuple[float, ...]] = field(default_factory=dict)  # cpu, mem_available, read, write

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "history": {k: list(v) for k, v in self.history.items()}}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> HostSnapshot:
        known = {f.name: raw[f.name] for f in fields(cls) if f.name in raw}
        known["per_core"] = tuple(known.get("per_core") or ())
        known["load"] = tuple(known.get("load") or (0.0, 0.0, 0.0))
        known["history"] = {str(k): tuple(v) for k, v in (raw.get("history") or {}).items()}
        return cls(**known)


@dataclass(frozen=True, kw_only=True)
class DeviceMemory:
    """One device's memory, read now (host memory on cpu)."""

    name: str
    total: int
    used: int
    free: int

    @property
    def fraction(self) -> float:
        return self.used / self.total if self.total else 0.0


@dataclass(frozen=True, kw_only=True)
class DeviceSnapshot:
    kind: str
    source: str  # meminfo | nvml | npu-smi
    utilization: float
    devices: tuple[DeviceMemory, ...] = ()
    budgets: tuple[RankKv, ...] = ()  # each rank's KV budget on its device (the plan's rule)
    slot_bytes: int | None = None  # one KV slot (the plan's)
    slots: int | None = None  # what the launch takes: every rank's slots (each --max-slots at most), summed
    fits: int | None = None  # what the memory holds, without the --max-slots cap (summed over ranks)
    max_slots: int = 32
    ranks: int = 1  # the launch's rank processes (the console's --ranks)
    error: str = ""  # the devices could not be read (never "cpu" instead)
    warning: str = ""  # about the devices as a whole (more ranks than devices)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "devices": [asdict(d) for d in self.devices],
                "budgets": [b.to_json() for b in self.budgets]}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> DeviceSnapshot:
        known = {f.name: raw[f.name] for f in fields(cls) if f.name in raw}
        known["devices"] = tuple(DeviceMemory(**{k: d[k] for k in ("name", "total", "used", "free")})
                                 for d in raw.get("devices") or ())
        known["budgets"] = tuple(RankKv.from_json(b) for b in raw.get("budgets") or ())
        return cls(**{"kind": "?", "source": "?", "utilization": 0.0, **known})


class HostCollector:
    """psutil rates between two calls, plus a short history for sparklines."""

    def __init__(self) -> None:
        self._disk = self._disk_counters()
        self._t = time.monotonic()
        psutil.cpu_percent(percpu=True)  # prime: the next call measures since now
        self._history: dict[str, deque[float]] = {k: deque(maxlen=HISTORY_POINTS)
                                                  for k in ("cpu", "mem_available", "read", "write")}

    @staticmethod
    def _disk_counters() -> tuple[int, int]:
        with contextlib.suppress(Exception):
            d = psutil.disk_io_counters()
            if d is not None:
                return d.read_bytes, d.write_bytes
        return 0, 0

    def __call__(self) -> HostSnapshot:
        per_core = tuple(psutil.cpu_percent(percpu=True))
        now, disk = time.monotonic(), self._disk_counters()
        dt = max(now - self._t, 1e-3)
        read, write = (max(0, disk[0] - self._disk[0]) / dt, max(0, disk[1] - self._disk[1]) / dt)
        self._disk, self._t = disk, now
        vm = psutil.virtual_memory()
        cpu = sum(per_core) / len(per_core) if per_core else 0.0
        for k, v in (("cpu", cpu), ("mem_available", vm.available), ("read", read), ("write", write)):
            self._history[k].append(float(v))
        load = (0.0, 0.0, 0.0)
        with contextlib.suppress(OSError, AttributeError):
            load = os.getloadavg()
        return HostSnapshot(cpu_percent=round(cpu, 1), per_core=per_core, load=tuple(round(x, 2) for x in load),
                            mem_total=vm.total, mem_available=vm.available, page_cache=getattr(vm, "cached", 0),
                            disk_read_bps=read, disk_write_bps=write,
                            history={k: tuple(v) for k, v in self._history.items()})


def collect_device(spec, kind: str, slot_bytes: int | None) -> DeviceSnapshot:
    """used / free / total per device and every rank's KV budget, by the rule the plan and
    registration's kv phase apply (`runtime.launch.budget.launch_kv`, on the memory read now), so
    the pane's slots are the plan's and a starving budget shows before launch."""
    from runtime.launch.budget import launch_kv
    from runtime.launch.hardware import read_memory

    reading = read_memory(kind, spec.device_memory)
    base = {"kind": kind, "source": reading.source, "utilization": spec.memory_utilization,
            "ranks": spec.ranks, "max_slots": spec.max_slots, "slot_bytes": slot_bytes}
    if reading.error:
        return DeviceSnapshot(**base, error=reading.error)
    devices = tuple(DeviceMemory(name=m.name, total=m.total, used=m.used, free=m.free) for m in reading.devices)
    if not slot_bytes:
        return DeviceSnapshot(**base, devices=devices)
    kv = launch_kv(kind, reading.devices, spec.ranks, slot_bytes, spec.memory_utilization, spec.max_slots,
                   spec.max_seq, spec.device_memory)
    return DeviceSnapshot(**base, devices=devices, budgets=tuple(RankKv.of(b) for b in kv.per_rank),
                          slots=kv.slots, fits=kv.fits, warning=kv.missing)
