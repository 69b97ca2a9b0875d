"""Host and device collectors: CPU, load, memory, page cache, disk rates (psutil) and device
memory with the KV budget (meminfo, NVML or `npu-smi`; never a device context, never torch)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import psutil

HISTORY_POINTS = 60  # sparkline length: two minutes at the default interval


@dataclass(frozen=True)
class HostSnapshot:
    cpu_percent: float = 0.0
    per_core: tuple[float, ...] = ()
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    mem_total: int = 0
    mem_available: int = 0
    page_cache: int = 0
    disk_read_bps: float = 0.0
    disk_write_bps: float = 0.0
    history: dict[str, tuple[float, ...]] = field(default_factory=dict)  # cpu, mem_available, read, write


@dataclass(frozen=True)
class DeviceSnapshot:
    kind: str
    source: str  # meminfo | nvml | npu-smi
    utilization: float
    devices: tuple[dict[str, Any], ...] = ()  # name, total, used, free, budget, warning; ranks, rank_budget
    slot_bytes: int | None = None  # one KV slot, from the last launch of this model
    error: str = ""
    ranks: int = 1  # the launch's rank processes (the console's --ranks)
    warning: str = ""  # about the devices as a whole (more ranks than devices)


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
        return HostSnapshot(round(cpu, 1), per_core, tuple(round(x, 2) for x in load), vm.total, vm.available,
                            getattr(vm, "cached", 0), read, write,
                            {k: tuple(v) for k, v in self._history.items()})


def resolve_device_kind(device: str) -> str:
    """`auto` → npu if npu-smi is on PATH, cuda if NVML answers, else cpu (never a device context)."""
    if device != "auto":
        return device
    if shutil.which("npu-smi"):
        return "npu"
    if _nvml_devices() is not None:
        return "cuda"
    return "cpu"


def _nvml_devices() -> list[tuple[str, int, int]] | None:
    """[(name, total, used)] through NVML, or None when pynvml is absent or no driver answers."""
    try:
        import pynvml  # optional: nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                name = pynvml.nvmlDeviceGetName(h)
                out.append((f"cuda:{i} {name.decode() if isinstance(name, bytes) else name}",
                            int(mem.total), int(mem.used)))
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


# `npu-smi info` prints, per NPU, a row whose HBM column reads "used / total" in MB.
_NPU_ROW = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|")
_NPU_HBM = re.compile(r"(\d+)\s*/\s*(\d+)\s*\|?\s*$")


def _npu_devices() -> list[tuple[str, int, int]] | None:
    try:
        text = subprocess.run(["npu-smi", "info"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    out, current = [], None
    for line in text.splitlines():
        m = _NPU_ROW.match(line)
        if m:
            current = f"npu:{m.group(1)} {m.group(2)}"
            continue
        hbm = _NPU_HBM.search(line)
        if current and hbm:
            used, total = int(hbm.group(1)) << 20, int(hbm.group(2)) << 20
            out.append((current, total, used))
            current = None
    return out or None


def collect_device(kind: str, utilization: float, slot_bytes: int | None, ranks: int = 1) -> DeviceSnapshot:
    """used / free / total per device and the KV budget (total × utilization − used), the same
    formula registration's kv phase applies, so a starving budget shows before launch.

    With several ranks, each rank sizes its own KV: on cpu they share host memory (each gets
    the budget / ranks); on cuda/npu rank r is device r (a device without a rank gets none)."""
    if kind == "cuda":
        found, source = _nvml_devices(), "nvml"
    elif kind == "npu":
        found, source = _npu_devices(), "npu-smi"
    else:
        vm = psutil.virtual_memory()
        found, source = [("cpu (host memory)", vm.total, vm.total - vm.available)], "meminfo"
    if found is None:
        return DeviceSnapshot(kind, source, utilization, error=f"{source} did not answer", ranks=ranks)
    rows = []
    for i, (name, total, used) in enumerate(found):
        budget = int(total * utilization) - used
        sharing = ranks if kind == "cpu" else 1 if ranks == 1 or i < ranks else 0
        mine = budget // sharing if sharing else budget
        warning = ""  # a device no rank uses sizes no KV cache: nothing to warn about
        if sharing and budget <= 0:
            warning = (f"residual usage leaves no KV budget (total × {utilization} − used ≤ 0): "
                       "the launch would fail at kv")
        elif sharing and slot_bytes and mine < slot_bytes:
            warning = ("budget is below one KV slot" + (" per rank" if sharing > 1 else "")
                       + ": the launch would fail at kv")
        rows.append({"name": name, "total": total, "used": used, "free": max(0, total - used),
                     "budget": budget, "slots": (mine // slot_bytes) if slot_bytes and mine > 0 else None,
                     "warning": warning, "ranks": sharing, "rank_budget": mine})
    short = ""
    if kind != "cpu" and ranks > len(found):
        short = f"{ranks} ranks need one {kind} device each, {len(found)} found"
    return DeviceSnapshot(kind, source, utilization, tuple(rows), slot_bytes, ranks=ranks, warning=short)
