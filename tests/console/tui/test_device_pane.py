"""The Device pane's per-device use: utilisation, memory, temperature and power as each serving
rank's device tool reads them (/health's `device_use`), `n/a` where none could say (a CPU)."""

from __future__ import annotations

import dataclasses

from console_fakes import snapshot

from console.data.services import ServicesSnapshot
from console.tui.once import render
from console.tui.panes.device import use_lines, use_text
from runtime.contract import DeviceUse, RankHealth


def _with_ranks(*ranks: RankHealth) -> ServicesSnapshot:
    [view] = snapshot().services.services
    return ServicesSnapshot((dataclasses.replace(view, detail=dataclasses.replace(view.detail, ranks=ranks)),))


def test_a_gpu_ranks_utilisation_memory_temperature_and_power_read_with_their_units():
    h100 = DeviceUse("NVIDIA H100 80GB HBM3", "nvml", utilization=87.0, memory_used=61 << 30, memory_total=80 << 30,
                     temperature=64.0, power=312.4)
    [line] = use_lines(_with_ranks(RankHealth(0, 32, 20, 12, "host-a", 4242, "cuda:0", "serve", device_use=h100)))
    assert line == "pid 4242 rank 0 NVIDIA H100 80GB HBM3: util 87% · mem 61.0 GiB / 80.0 GiB · 64 °C · 312 W"


def test_what_a_tool_did_not_say_and_a_cpu_rank_read_n_a():
    assert use_text(DeviceUse("Ascend 910B", "npu-smi", memory_used=1 << 30)) == (
        "util n/a · mem 1.0 GiB · temp n/a · power n/a")
    cpu = RankHealth(0, 32, 20, 12, "host-a", 4242, "cpu", "serve")
    assert use_lines(_with_ranks(cpu)) == ["pid 4242 rank 0 cpu: util, temp, power n/a (no accelerator)"]


def test_once_shows_the_same_lines_under_device():
    device = render(snapshot()).split("Device (", 1)[1]
    assert "pid 4242 rank 0 cpu: util, temp, power n/a (no accelerator)" in device.split("\n\n", 1)[0]
