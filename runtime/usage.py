"""What a rank process uses: its CPU and resident memory (psutil), and its accelerator's
utilisation, memory, temperature and power — through NVML on a GPU (nvidia-ml-py, the `cuda`
extra, imported only when a cuda rank asks), from `npu-smi` on an NPU, none on the CPU ("n/a").

Each rank reads its own (`Usage.read`, at most every MIN_EVERY_S: a read in between gives the last)
and posts it with its heartbeat (runtime.launch.liveness), so rank 0's /health says every rank's,
on every host, without a store round trip of its own. Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import threading
import time
from dataclasses import asdict
from typing import Any

import psutil

from runtime.contract import DeviceUse

MIN_EVERY_S = 1.0
_nvml_lock = threading.Lock()
_nvml: dict[str, Any] = {}  # "module": pynvml once initialised here; "error": why it cannot be


def device_index(device: str) -> tuple[str, int]:
    """`cuda:1` → ("cuda", 1); `cpu` → ("cpu", 0)."""
    kind, _, index = device.partition(":")
    return kind, int(index) if index.isdigit() else 0


def nvml_use(index: int) -> DeviceUse | None:
    """The GPU this process sees as cuda:`index`, through NVML; None without nvidia-ml-py or NVML."""
    from runtime.toolchain import nvml_handles

    with _nvml_lock:
        if "module" not in _nvml and "error" not in _nvml:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml["module"] = pynvml
            except Exception as e:  # not installed, or no driver: said once, as n/a
                _nvml["error"] = str(e)
        pynvml = _nvml.get("module")
        if pynvml is None:
            return None
        try:
            handle = nvml_handles(pynvml)[index]
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            util = pynvml.nvmlDeviceGetUtilizationRates(handle)
        except Exception:
            return None
        temp = power = None
        with contextlib.suppress(Exception):
            temp = float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU))
        with contextlib.suppress(Exception):
            power = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # milliwatts
        return DeviceUse(f"cuda:{index} {name}", "nvml", float(util.gpu), int(mem.used), int(mem.total), temp, power)


# `npu-smi info`: a chip's first row "| 0     910B3     | OK            | 93.4        52                0    / 0   |"
# (NPU, name | health | power W, temperature °C, hugepages), its second
# "| 0 | 0000:C1:00.0 | 3   0    / 0   3384 / 65536 |"
# (chip | bus id | AICore %, memory used / total MB, HBM used / total MB)
_NPU_FIRST = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|\s*\S+\s*\|\s*([\d.]+)\s+([\d.]+)")
_NPU_SECOND = re.compile(r"^\|\s*\d+\s*\|\s*[0-9A-Fa-f:.]+\s*\|\s*(\d+)\s+.*?(\d+)\s*/\s*(\d+)\s*\|?\s*$")


def parse_npu_smi(text: str) -> dict[int, DeviceUse]:
    """Each NPU's use from `npu-smi info`'s table."""
    out: dict[int, DeviceUse] = {}
    current = None
    for line in text.splitlines():
        if m := _NPU_FIRST.match(line):
            current = (int(m.group(1)), m.group(2), float(m.group(3)), float(m.group(4)))
            continue
        if current is not None and (m := _NPU_SECOND.match(line)):
            npu, name, power, temp = current
            used, total = int(m.group(2)) << 20, int(m.group(3)) << 20
            out[npu] = DeviceUse(f"npu:{npu} {name}", "npu-smi", float(m.group(1)), used, total, temp, power)
            current = None
    return out


def npu_use(index: int) -> DeviceUse | None:
    try:
        text = subprocess.run(["npu-smi", "info"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    from runtime.toolchain import visible

    seen = visible("npu", 1 << 10)
    npu = int(seen[index]) if index < len(seen) and seen[index].isdigit() else index
    return parse_npu_smi(text).get(npu)


def device_use(device: str) -> DeviceUse | None:
    kind, index = device_index(device)
    if kind == "cuda":
        return nvml_use(index)
    if kind == "npu":
        return npu_use(index)
    return None


class Usage:
    """This process's CPU, RSS and device use, read at most every MIN_EVERY_S."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._proc = psutil.Process()
        self._proc.cpu_percent(None)  # the first reading starts the interval
        self._at = 0.0
        self._last: dict[str, Any] = {}
        self._lock = threading.Lock()

    def read(self) -> dict[str, Any]:
        """{"cpu_percent", "rss_bytes", "device_use"}: what RankHealth takes."""
        with self._lock:
            now = time.monotonic()
            if now - self._at >= MIN_EVERY_S or not self._last:
                use = device_use(self.device)
                with contextlib.suppress(psutil.Error):
                    self._last = {"cpu_percent": round(self._proc.cpu_percent(None), 1),
                                  "rss_bytes": self._proc.memory_info().rss,
                                  "device_use": asdict(use) if use is not None else None}
                self._at = now
            return dict(self._last)

    def line(self) -> str:
        return json.dumps(self.read(), separators=(",", ":"))
