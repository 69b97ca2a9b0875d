"""A kernel cache of synthetic entries (4 KiB artifacts, a quarter built by an older torch, so
stale), for the benches that time listing and showing a large cache (torch-free)."""

from __future__ import annotations

import os
from pathlib import Path

from store.fingerprint import Key
from store.kernel_cache import KernelCache


def synthetic_cache(root: Path, n: int) -> KernelCache:
    from runtime.programs.spec import CONFIG_COMPONENTS
    from runtime.toolchain import toolchain_components

    cache = KernelCache(root, durable=False)  # synthetic: fsync would only time the disk
    toolchain = dict(toolchain_components("cpu"))
    for i in range(n):
        program, variant = f"layer{i % 50:02d}.decode", i // 50
        torch_version = toolchain["torch"] if variant % 4 else "2.12.0"  # a quarter stale
        key = [
            ("backend", "aoti"),
            ("layout", {"tp": variant}),
            (f"source:{program}", f"{i:016x}"),
            *{**toolchain, "torch": torch_version}.items(),
        ]
        cache.publish(program, Key.of(key), {"program.pt2": os.urandom(4096)}, config_components=CONFIG_COMPONENTS)
    return cache
