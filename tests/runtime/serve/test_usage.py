"""A rank's use (issue 71, item 4): its CPU and RSS from psutil; its GPU through NVML (here a stand-in
pynvml module answering as NVML does: the figures' units converted), its NPU from `npu-smi info`'s
table, none on the CPU."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from runtime import usage


def test_a_cpu_rank_reads_its_own_cpu_and_memory_and_no_device():
    got = usage.Usage("cpu").read()
    assert got["device_use"] is None and got["rss_bytes"] > 10 << 20 and got["cpu_percent"] >= 0.0


def test_a_gpu_is_read_through_nvml_in_watts_and_bytes(monkeypatch):
    fake = SimpleNamespace(
        NVML_TEMPERATURE_GPU=0, nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}", nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=70 << 30, total=80 << 30, free=10 << 30),
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=97 if h == "gpu1" else 5, memory=40),
        nvmlDeviceGetTemperature=lambda h, sensor: 61, nvmlDeviceGetPowerUsage=lambda h: 402500)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(usage, "_nvml", {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # this process's cuda:0 is NVML's GPU 1
    got = usage.device_use("cuda:0")
    assert got == usage.DeviceUse("cuda:0 NVIDIA H100 80GB HBM3", "nvml", 97.0, 70 << 30, 80 << 30, 61.0, 402.5)


def test_without_nvml_a_gpu_rank_says_nothing_rather_than_failing(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    monkeypatch.setattr(usage, "_nvml", {})
    assert usage.device_use("cuda:0") is None


NPU_SMI = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.0                   Version: 23.0.0                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.4        52                0    / 0             |
| 0                         | 0000:C1:00.0  | 3           0    / 0          3384 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 180.2       58                0    / 0             |
| 0                         | 0000:C2:00.0  | 87          0    / 0          60000/ 65536         |
+===========================+===============+====================================================+
"""


def test_an_npu_is_read_from_npu_smi():
    got = usage.parse_npu_smi(NPU_SMI)
    assert got[0] == usage.DeviceUse("npu:0 910B3", "npu-smi", 3.0, 3384 << 20, 65536 << 20, 52.0, 93.4)
    assert got[1].utilization == 87.0 and got[1].memory_used == 60000 << 20 and got[1].power == 180.2
