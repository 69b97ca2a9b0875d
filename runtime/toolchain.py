"""Toolchain components of a program key: torch's version (read from its package files, never
imported), Python, the device's capability, the C++ compiler, and the env flags that change
generated code. Torch-free on cpu; cuda/npu capability needs the device runtime."""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from store.fingerprint import UNKNOWN

# CPU flags that change the code Inductor generates (vector ISA selection).
_CPU_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
    "asimd", "sve", "sve2",
)  # fmt: skip
# Inductor env knobs that only say where caches live or how much to log: not in the key.
_ENV_IGNORED = re.compile(r"^TORCHINDUCTOR_(CACHE_DIR|FX_GRAPH_CACHE|AUTOGRAD_CACHE|.*LOG.*)$")
_ENV_RELEVANT = re.compile(r"^(TORCHINDUCTOR_|TORCH_COMPILE_|TORCH_CUDA_ARCH_LIST$|CXXFLAGS$)")


def toolchain_components(device: str, backend: str = "aoti") -> list[tuple[str, Any]]:
    """Versions and capabilities that change compiled code; torch-free except for cuda/npu."""
    parts: list[tuple[str, Any]] = [
        ("torch", _torch_version()),
        ("torch.git", _torch_git_version()),
        ("python", platform.python_version()),
        (f"device.{device}", device_capability(device)),
    ]
    if backend == "aoti":
        parts.append(("compiler", compiler_version()))
    parts.append(("env", relevant_env()))
    return parts


def _torch_version() -> str:
    return torch_build().get("__version__", UNKNOWN)


def _torch_git_version() -> str:
    return torch_build().get("git_version", UNKNOWN)


@functools.cache
def torch_build() -> dict[str, str]:
    """torch/version.py's string fields (`__version__`, `git_version`, `cuda` on a CUDA build,
    `hip` on ROCm), read as text: what the installed torch is, without importing it."""
    # torch/version.py read as text (what torch.__version__ comes from): finding the package's
    # spec does not import it, so `dsv4 cache ls` stays torch-free.
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return {}
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return {}
    return dict(re.findall(r"^(\w+)\s*(?::[^=]*)?=\s*['\"]([^'\"]*)['\"]", text, re.MULTILINE))


_torch_free = False


def stay_torch_free() -> None:
    """This process never imports torch (dsv4-console: it starts fast and opens no device
    context): a capability only torch could read is UNKNOWN here, and the plan says so."""
    global _torch_free
    _torch_free = True


def device_capability(device: str) -> Any:
    """CPU ISA flags / CUDA compute capability / NPU SoC name; UNKNOWN if undeterminable.

    CUDA's comes without torch (NVML when nvidia-ml-py is installed, the `cuda` extra; else
    `nvidia-smi`, which every driver ships), an NPU's from `npu-smi` (its chip name), so a
    process without torch (the console's plan) computes the same keys as the launch. Only
    where none answers is torch asked, and never in a process that said it stays torch-free
    (`stay_torch_free`: the console)."""
    if device == "cpu":
        return {"machine": platform.machine(), "flags": _cpu_flags()}
    if device == "cuda" and (capability := _nvml_capability() or _smi_capability()) is not None:
        return capability
    if device == "npu" and (chip := _npu_chip()) is not None:
        return chip
    if _torch_free:
        return UNKNOWN
    try:
        import torch

        if device == "cuda":
            major, minor = torch.cuda.get_device_capability()
            return f"sm_{major}{minor}"
        if device == "npu":
            import torch_npu  # noqa: F401 - registers torch.npu

            return torch.npu.get_soc_version() if hasattr(torch.npu, "get_soc_version") else UNKNOWN
    except Exception:
        return UNKNOWN
    return UNKNOWN


VISIBLE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def visible(kind: str, present: int) -> list[str]:
    """The devices of `kind` this process sees, in its own order (its device 0 first), out of
    `present`: every one when the visibility variable is unset; else its entries as the device
    runtime reads them, up to the first that names no device (an index past the last, "-1",
    an empty entry); an entry that is not a number (a UUID) is kept as given."""
    raw = os.environ.get(VISIBLE_ENV.get(kind, ""))
    if raw is None:
        return [str(i) for i in range(present)]
    out: list[str] = []
    for entry in (e.strip() for e in raw.split(",")):
        if entry.isdigit() and int(entry) < present:
            name = str(int(entry))
        elif entry and not entry.lstrip("+-").isdigit():
            name = entry
        else:
            break
        if name not in out:
            out.append(name)
    return out


def nvml_handles(pynvml) -> list:
    """NVML's handles of the GPUs this process sees, in CUDA's order (cuda:0 first): NVML itself
    counts every GPU of the host, whatever CUDA_VISIBLE_DEVICES hides or reorders. (CUDA's
    default FASTEST_FIRST order is taken to be NVML's PCI order, as on a host of one model.)"""
    handles = []
    for entry in visible("cuda", pynvml.nvmlDeviceGetCount()):
        if entry.isdigit():
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(entry)))
            continue
        try:
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(entry))
        except Exception:  # an entry that names no GPU: CUDA stops there too
            break
    return handles


@functools.cache
def _nvml_capability() -> str | None:
    """cuda:0's compute capability through NVML (what torch.cuda.get_device_capability says):
    the first GPU this process sees, not NVML's first."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handles = nvml_handles(pynvml)
            if not handles:
                return None
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handles[0])
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
    return f"sm_{major}{minor}"


@functools.cache
def _smi_capability() -> str | None:
    """cuda:0's compute capability as `nvidia-smi` reports it (NVML's order, mapped through
    CUDA_VISIBLE_DEVICES like `nvml_handles`)."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.count(",") == 2]
    by_name = {**{r[0]: r[2] for r in rows}, **{r[1]: r[2] for r in rows}}
    seen = visible("cuda", len(rows))
    cap = by_name.get(seen[0]) if out.returncode == 0 and seen else None
    if not cap or not re.fullmatch(r"\d+\.\d+", cap):
        return None
    major, minor = cap.split(".")
    return f"sm_{major}{minor}"


# `npu-smi info`: each NPU's first row, "| 0     910B3    | OK | …": its id and chip name
NPU_ROW = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|")


@functools.cache
def _npu_chip() -> str | None:
    """The chip name `npu-smi info` gives the first NPU this process sees."""
    if not shutil.which("npu-smi"):
        return None
    try:
        text = subprocess.run(["npu-smi", "info"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    chips = dict(m.groups() for line in text.splitlines() if (m := NPU_ROW.match(line)))
    seen = visible("npu", len(chips))
    return chips.get(seen[0]) if seen else None


@functools.cache
def cpu_vendor() -> str | None:
    """The cpu's `vendor_id` ("GenuineIntel", "AuthenticAMD"), from its first line in /proc/cpuinfo;
    None where there is none (not Linux, not x86)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), None)
    except OSError:
        return None


def _cpu_flags() -> list[str] | str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return UNKNOWN
    found: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            found.update(line.split(":", 1)[1].split())
    return sorted(found.intersection(_CPU_FLAGS))


def cxx() -> str | None:
    """The C++ compiler Inductor would use (CXX, else g++/clang++/c++ on the PATH), None if none:
    what builds every compiled program, `runtime.model.native`'s too."""
    return os.environ.get("CXX") or next((c for c in ("g++", "clang++", "c++") if shutil.which(c)), None)


@functools.cache
def compiler_version() -> str:
    """First line of `--version` of the C++ compiler (`cxx`)."""
    compiler = cxx()
    if not compiler:
        return UNKNOWN
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN
    first = out.stdout.strip().splitlines()[:1]
    return first[0] if out.returncode == 0 and first else UNKNOWN


def relevant_env() -> dict[str, str]:
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if _ENV_RELEVANT.match(k) and not _ENV_IGNORED.match(k)
    }
