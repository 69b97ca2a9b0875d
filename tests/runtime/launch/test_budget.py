"""One budget and one device resolution: the KV rule every caller shares (the plan, registration's
kv phase, the Device pane), `--device auto` decided once without torch, and device memory that
cannot be read said so — never taken for cpu."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
from conftest import REPO
from console_fakes import SPEC

from console.data.host import collect_device
from runtime.launch import hardware
from runtime.launch.budget import Memory, kv_budget, launch_kv
from runtime.launch.device import get_device

GIB = 1 << 30


def test_the_budget_is_total_times_utilization_less_used_shared_and_capped_by_max_slots():
    mem = Memory(16 * GIB, 8 * GIB, 8 * GIB, "cpu (host memory)")
    one = kv_budget(mem, 1 << 20, 0.9, 32)
    assert one.budget == int(16 * GIB * 0.9) - 8 * GIB and one.fits == one.budget // (1 << 20)
    assert one.slots == 32 and one.capped and one.problem == ""
    two = kv_budget(mem, 1 << 20, 0.9, 32, share=2)
    assert two.budget == one.budget // 2 and two.slots == 32
    starving = kv_budget(Memory(16 * GIB, 0, 16 * GIB), 1 << 20, 0.9, 32)
    assert starving.slots == 0 and starving.problem.startswith("residual usage leaves no KV budget")
    small = kv_budget(Memory(16 * GIB, 8 * GIB, 8 * GIB), 8 * GIB, 0.9, 32)
    assert small.slots == 0 and small.problem.startswith("not even one KV slot fits")


def test_a_device_memory_cap_is_the_device_on_cpu_and_lowers_an_accelerator():
    host = Memory(64 * GIB, 40 * GIB, 24 * GIB, "cpu (host memory)")
    assert host.capped(8 * GIB, "cpu") == Memory(8 * GIB, 8 * GIB, 0, "cpu (host memory)")
    assert host.capped(8 * GIB, "cpu", allocated=GIB).free == 7 * GIB
    gpu = Memory(80 * GIB, 70 * GIB, 10 * GIB, "cuda:0")
    assert gpu.capped(40 * GIB, "cuda") == Memory(40 * GIB, 40 * GIB, 0, "cuda:0")
    assert gpu.capped(None, "cuda") is gpu


def test_ranks_split_host_memory_on_cpu_and_own_a_device_each_on_accelerators():
    host = [Memory(16 * GIB, 16 * GIB, 0, "cpu")]
    cpu = launch_kv("cpu", host, 4, 1 << 20, 0.5, 8, 64)
    # each rank holds its own sequences' KV: the service's slots are the ranks' sum
    assert [b.share for b in cpu.per_rank] == [4] * 4 and cpu.slots == 4 * 8 and cpu.problem == ""
    assert cpu.fits == 4 * (8 * GIB // 4 // (1 << 20))
    gpus = [Memory(80 * GIB, 80 * GIB, 0, f"cuda:{i}") for i in range(2)]
    cuda = launch_kv("cuda", gpus, 4, GIB, 0.9, 100, 64)
    assert [b.memory.name for b in cuda.per_rank] == ["cuda:0", "cuda:1"]
    assert cuda.problem == "4 ranks need one cuda device each, 2 found"


def test_on_cpu_device_memory_is_each_ranks_own_device_and_slots_grow_with_the_ranks():
    device = [Memory(2 * GIB, 2 * GIB, 0, "cpu")]  # --device-memory 2G, as read_memory caps it
    one = launch_kv("cpu", device, 1, 1 << 20, 0.5, 4096, 64, device_memory=2 * GIB)
    for ranks in (2, 4):
        many = launch_kv("cpu", device, ranks, 1 << 20, 0.5, 4096, 64, device_memory=2 * GIB)
        assert [b.share for b in many.per_rank] == [1] * ranks
        assert [b.slots for b in many.per_rank] == [one.slots] * ranks and many.slots == ranks * one.slots
    shared = launch_kv("cpu", device, 2, 1 << 20, 0.5, 4096, 64)  # no cap: the host's memory, split
    assert shared.slots == one.slots - one.slots % 2


def test_the_device_pane_and_the_plan_take_the_same_slots(tiny_ckpt_ro, tmp_path, monkeypatch):
    from runtime.launch.plan import make_plan

    fixed = hardware.Reading("cpu", "meminfo", (Memory(16 * GIB, 9 * GIB, 7 * GIB, "cpu (host memory)"),))
    monkeypatch.setattr(hardware, "read_memory", lambda kind, cap=None: fixed)
    for spec in (SPEC.with_(model=tiny_ckpt_ro, kernel_cache_dir=tmp_path, backend="export"),
                 SPEC.with_(model=tiny_ckpt_ro, kernel_cache_dir=tmp_path, backend="export", ranks=2,
                            max_slots=4096, memory_utilization=0.5)):
        plan = make_plan(spec, history=[])
        pane = collect_device(spec, "cpu", plan.kv.slot_bytes)
        assert (pane.slots, pane.fits) == (plan.kv.slots, plan.kv.fits) and pane.slots >= 1
        assert [b.budget for b in pane.budgets] == [b.budget for b in plan.kv.per_rank]


def test_auto_is_decided_once_without_torch(monkeypatch):
    assert hardware.resolve_device("auto") == get_device("auto").kind == "cpu"  # this host: no accelerator
    monkeypatch.setattr(hardware, "accelerator_count", lambda kind: 2 if kind == "cuda" else 0)
    monkeypatch.setattr(hardware, "torch_build", lambda: {"__version__": "2.13.0+cu128", "cuda": "12.8"})
    assert hardware.resolve_device("auto") == "cuda"
    monkeypatch.setattr(hardware, "torch_build", lambda: {"__version__": "2.13.0+cpu"})
    assert hardware.resolve_device("auto") == "cpu"  # GPUs, but a torch that cannot drive them
    assert hardware.resolve_device("npu") == "npu"


def test_unreadable_device_memory_says_so_and_never_passes_for_cpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed
    snap = collect_device(SPEC, "cuda", 1 << 20)
    assert snap.kind == "cuda" and snap.devices == () and snap.slots is None
    assert "nvidia-ml-py" in snap.error and "pip install -e '.[cuda]'" in snap.error

    def broken():
        raise RuntimeError("driver not loaded")

    fake = types.SimpleNamespace(nvmlInit=broken, nvmlShutdown=lambda: None)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert hardware.read_memory("cuda").error == "NVML did not answer (driver not loaded)"


@pytest.mark.parametrize("cap", [None, 16 * GIB])
def test_nvml_memory_is_read_per_device(monkeypatch, cap):
    class Info:
        total, used = 80 * GIB, 2 * GIB

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetMemoryInfo=lambda h: Info,
        nvmlDeviceGetName=lambda h: b"NVIDIA H200")
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    reading = hardware.read_memory("cuda", cap)
    assert [m.name for m in reading.devices] == ["cuda:0 NVIDIA H200", "cuda:1 NVIDIA H200"]
    assert reading.devices[0].total == (cap or 80 * GIB) and reading.source == "nvml"


def _four_gpus(monkeypatch):
    class Info:
        total, used = 80 * GIB, 2 * GIB

    uuids = {f"GPU-{i}aa": i for i in range(4)}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetHandleByUUID=lambda u: uuids[u],
        nvmlDeviceGetMemoryInfo=lambda h: Info, nvmlDeviceGetName=lambda h: f"GPU{h}",
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, h))
    monkeypatch.setitem(sys.modules, "pynvml", fake)


@pytest.mark.parametrize(("visible", "names"), [
    (None, ["cuda:0 GPU0", "cuda:1 GPU1", "cuda:2 GPU2", "cuda:3 GPU3"]),
    ("2,0", ["cuda:0 GPU2", "cuda:1 GPU0"]),  # reordered: cuda:0 is the host's third GPU
    ("1,7,3", ["cuda:0 GPU1"]),  # CUDA stops at the first entry that names no device
    ("3,-1,0", ["cuda:0 GPU3"]),
    ("GPU-2aa,GPU-nope,1", ["cuda:0 GPU2"]),  # by UUID, as far as NVML knows them
    ("", []),
])
def test_device_memory_and_capability_follow_cuda_visible_devices(monkeypatch, visible, names):
    from runtime import toolchain

    _four_gpus(monkeypatch)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    reading = hardware.read_memory("cuda")
    assert [m.name for m in reading.devices] == names
    assert bool(reading.error) == (not names)
    toolchain._nvml_capability.cache_clear()
    try:  # the program keys' capability is cuda:0's: the first GPU this process sees
        assert toolchain._nvml_capability() == (f"sm_9{names[0].split('GPU')[1]}" if names else None)
    finally:
        toolchain._nvml_capability.cache_clear()


def test_the_devices_a_process_sees_are_counted_as_its_runtime_counts_them(monkeypatch):
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "6,2,2,9")
    assert hardware.visible("npu", 8) == ["6", "2"]  # a repeat is one device; 9 is past the last
    assert hardware.visible("npu", 4) == []  # its first entry names no device: none after it counts
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES")
    assert hardware.visible("npu", 3) == ["0", "1", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert hardware.accelerator_count("cuda") == 0  # nothing visible, whatever /dev holds


def test_npu_smi_rows_are_read_as_devices():
    text = ("| 0     910B3               | OK            | 93.5        45                0    / 0             |\n"
            "| 0                         | 0000:C1:00.0  | 0           0    / 0          3396 / 65536         |\n")
    [npu] = hardware.parse_npu_smi(text)
    assert npu.name == "npu:0 910B3" and npu.total == 65536 << 20 and npu.used == 3396 << 20


def test_capability_comes_from_nvidia_smi_or_npu_smi_without_torch_and_never_through_torch_in_the_console(
        tmp_path):
    """No nvidia-ml-py: `nvidia-smi` answers (cuda:0 is the GPU CUDA_VISIBLE_DEVICES names
    first); with neither, the console's process says UNKNOWN rather than import torch."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\nprintf '0, GPU-aaa, 8.0\\n1, GPU-bbb, 9.0\\n'\n")
    smi.chmod(0o755)
    (tmp_path / "bin" / "npu-smi").write_text(
        "#!/bin/sh\nprintf '| 0     910B3     | OK  | 93.5  45  0 / 0 |\\n"
        "| 0           | 0000:C1:00.0 | 0 0 / 0 3396 / 65536 |\\n"
        "| 1     910B4     | OK  | 93.5  45  0 / 0 |\\n| 0           | 0000:C2:00.0 | 0 0 / 0 3396 / 65536 |\\n'\n")
    (tmp_path / "bin" / "npu-smi").chmod(0o755)

    def ask(path: str, kind: str, visible: str) -> str:
        script = ("import sys; sys.modules['pynvml'] = None\n"
                  "from runtime import toolchain\n"
                  "toolchain.stay_torch_free()\n"
                  f"print(toolchain.device_capability({kind!r}), 'torch' in sys.modules)\n")
        env = {**os.environ, "PATH": path, "CUDA_VISIBLE_DEVICES": visible, "ASCEND_RT_VISIBLE_DEVICES": visible}
        r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert ask(f"{smi.parent}:/usr/bin:/bin", "cuda", "1") == "sm_90 False"
    assert ask(f"{smi.parent}:/usr/bin:/bin", "cuda", "GPU-aaa") == "sm_80 False"
    assert ask(f"{smi.parent}:/usr/bin:/bin", "npu", "1") == "910B4 False"
    assert ask(str(tmp_path / "nothing"), "cuda", "0") == "<unknown> False"
    assert ask(str(tmp_path / "nothing"), "npu", "0") == "<unknown> False"
