"""Shared pieces of the kernel cache tests: sample keys, publishing a sample entry, the entry's
directory, the quarantine listing, and the `cache` fixture (an empty root under tmp_path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.programs.spec import CONFIG_COMPONENTS
from runtime.toolchain import toolchain_components
from store.fingerprint import Key, fingerprint
from store.kernel_cache import QUARANTINE, Hit, KernelCache

WORKER = Path(__file__).with_name("worker_kernel_cache.py")
ART = "program.pt2"
PAYLOAD = b"\x7fELF pretend this is a compiled program" * 64


def make_key(**changes) -> Key:
    components = {
        "backend": "export",
        "device": "cpu",
        "signature": {"inputs": [{"name": "x", "dtype": "float32", "shape": ["tokens", 8]}]},
        "layout": {"tp": 1},
        "model_dims": {"hidden": 8},
        "source:model.layer": "1111aaaa",
        **dict(toolchain_components("cpu")),
    }
    components.update(changes)
    return Key.of(components)


def put(cache: KernelCache, key: Key, program: str = "layer", data: bytes = PAYLOAD) -> Hit:
    return cache.publish(program, key, {ART: data}, config_components=CONFIG_COMPONENTS)


def entry_dir(cache: KernelCache, key: Key, program: str = "layer") -> Path:
    return cache.root / "v1" / program / fingerprint(key)


def quarantined(cache: KernelCache) -> list[Path]:
    q = cache.root / QUARANTINE
    return sorted(q.iterdir()) if q.exists() else []


@pytest.fixture
def cache(tmp_path) -> KernelCache:
    return KernelCache(tmp_path / "programs")
