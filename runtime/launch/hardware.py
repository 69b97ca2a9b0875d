"""The host's devices without torch and without a device context: which device `auto` means,
how many accelerators there are, and each one's memory (host memory, NVML, `npu-smi`).

The one resolver of `--device auto` (npu > cuda > cpu): the plan, the console and the runtime
(`runtime.launch.device.get_device`) all call `resolve_device`, so they never disagree. A device
is chosen when the host has it *and* the installed torch can drive it: torch's CUDA support is
read from its version file, torch_npu's presence from its package spec, neither imported.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import subprocess
from dataclasses import dataclass

import psutil

from runtime.launch.budget import Memory
from runtime.toolchain import NPU_ROW, nvml_handles, torch_build, visible

NVML_HINT = "install nvidia-ml-py (pip install -e '.[cuda]')"


def resolve_device(name: str) -> str:
    """`auto` → npu > cuda > cpu, as this host and its torch allow; any other name as given."""
    if name != "auto":
        return name
    if importlib.util.find_spec("torch_npu") is not None and accelerator_count("npu"):
        return "npu"
    if torch_build().get("cuda") and accelerator_count("cuda"):
        return "cuda"
    return "cpu"


_NODES = {"cuda": re.compile(r"nvidia\d+"), "npu": re.compile(r"davinci\d+")}


def accelerator_count(kind: str) -> int:
    """Accelerators this process may use: the driver's device nodes (no device context), as
    far as CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES let it see them."""
    pattern = _NODES.get(kind)
    if pattern is None:
        return 0
    try:
        present = sum(bool(pattern.fullmatch(n)) for n in os.listdir("/dev"))
    except OSError:
        return 0
    return len(visible(kind, present))


@dataclass(frozen=True)
class Reading:
    """Every device of one kind on this host, or why they could not be read."""

    kind: str
    source: str  # meminfo | nvml | npu-smi
    devices: tuple[Memory, ...] = ()
    error: str = ""


def read_memory(kind: str, cap: int | None = None) -> Reading:
    """Memory of each device of `kind` (host memory for cpu), capped like --device-memory."""
    if kind == "cuda":
        found, source, error = _nvml()
    elif kind == "npu":
        found, source, error = _npu_smi()
    else:
        vm = psutil.virtual_memory()
        found, source, error = [Memory(vm.total, vm.available, vm.total - vm.available, "cpu (host memory)")], \
            "meminfo", ""
    if not found:
        return Reading(kind, source, error=error or f"{source} found no {kind} device")
    return Reading(kind, source, tuple(m.capped(cap, kind) for m in found))


def _nvml() -> tuple[list[Memory], str, str]:
    try:
        import pynvml  # optional: nvidia-ml-py (the `cuda` extra)
    except ImportError:
        return [], "nvml", f"cuda device memory unreadable: {NVML_HINT}"
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return [], "nvml", f"NVML did not answer ({e})"
    try:
        out = []
        for i, h in enumerate(nvml_handles(pynvml)):
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            out.append(Memory(int(mem.total), int(mem.total) - int(mem.used), int(mem.used), f"cuda:{i} {name}"))
        return out, "nvml", ""
    except Exception as e:
        return [], "nvml", f"NVML did not answer ({e})"
    finally:
        with contextlib.suppress(Exception):  # shutting down a half-initialised NVML says nothing new
            pynvml.nvmlShutdown()


# `npu-smi info` prints, per NPU, a row whose HBM column reads "used / total" in MB.
_NPU_HBM = re.compile(r"(\d+)\s*/\s*(\d+)\s*\|?\s*$")


def _npu_smi() -> tuple[list[Memory], str, str]:
    try:
        text = subprocess.run(["npu-smi", "info"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return [], "npu-smi", f"npu device memory unreadable: npu-smi did not run ({e})"
    return parse_npu_smi(text), "npu-smi", ""


def parse_npu_smi(text: str) -> list[Memory]:
    out, current = [], None
    for line in text.splitlines():
        m = NPU_ROW.match(line)
        if m:
            current = f"npu:{m.group(1)} {m.group(2)}"
            continue
        hbm = _NPU_HBM.search(line)
        if current and hbm:
            used, total = int(hbm.group(1)) << 20, int(hbm.group(2)) << 20
            out.append(Memory(total, total - used, used, current))
            current = None
    return out

