"""What a host builds and runs with, as the fleet compares it: dsv4's version and the toolchain
components of a program key (`runtime.toolchain`: torch, its git revision, Python, the
device's capability, the C++ compiler, the env flags that change generated code), each as one
short string. Torch-free: torch's version is read from its package files."""

from __future__ import annotations

import json
from typing import Any

# the components a person names first when two hosts differ (the rest follow in key order)
ORDER = ("dsv4", "torch", "torch.git", "python", "device", "compiler", "env")


def _text(value: Any) -> str:
    if isinstance(value, dict) and set(value) == {"machine", "flags"}:  # a CPU: its ISA flags
        flags = value["flags"] if isinstance(value["flags"], list) else [str(value["flags"])]
        return " ".join([str(value["machine"]), *flags])
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in sorted(value.items())) or "-"
    if isinstance(value, list | tuple):
        return " ".join(map(str, value))
    return str(value)


def toolchain(device_kind: str) -> dict[str, str]:
    """This host's toolchain, component → short text (`device` is `cpu: x86_64 avx avx2 …`)."""
    from console.about import version
    from runtime.toolchain import toolchain_components

    out = {"dsv4": version()}
    for name, value in toolchain_components(device_kind, "aoti"):
        key = "device" if name.startswith("device.") else name
        out[key] = f"{device_kind}: {_text(value)}" if key == "device" else _text(value)
    return out


def canonical(tool: dict[str, str]) -> str:
    return json.dumps(tool, sort_keys=True)
