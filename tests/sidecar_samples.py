"""A tiny checkpoint dir and sample sidecars for the tests/test_sidecar_*.py files: the fixtures
(`model_dir`, a per-test state dir), sample tensors of every dtype, and the writer call they share.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from store import sidecar
from store.sidecar import TensorShape

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"format": "dsv4-packed-test", "packer_version": "t1", "ranks": 2, "layout": {"e": 1}}
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.int8: "I8", torch.int32: "I32",
    torch.int64: "I64", torch.float16: "F16", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
}  # fmt: skip


@pytest.fixture(autouse=True)
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": 8}))
    save_file({"embed.weight": torch.ones(4, 8)}, d / SHARDS[0])
    save_file({"head.weight": torch.zeros(4, 8)}, d / SHARDS[1])
    index = {"metadata": {}, "weight_map": {"embed.weight": SHARDS[0], "head.weight": SHARDS[1]}}
    (d / sidecar.INDEX_NAME).write_text(json.dumps(index))
    return d


def sample_tensors(fill: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(fill)
    return {
        "layers.w_int8": torch.randint(-128, 127, (3, 5), dtype=torch.int8, generator=g),
        "layers.scale": torch.rand(3, generator=g) + fill,
        "norm.weight": torch.rand(7, generator=g).to(torch.bfloat16),
        "gate.tid2eid": torch.arange(6, dtype=torch.int32).reshape(3, 2) + fill,
        "counts": torch.arange(3, dtype=torch.int64) + fill,
        "half": torch.rand(2, 2, generator=g).to(torch.float16),
        "mask": torch.tensor([True, False, True]),
        "fp8": torch.rand(4, 4, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(float(fill)),
        "empty": torch.zeros(0, 4),
    }


def plan_of(tensors: dict[str, torch.Tensor]) -> list[TensorShape]:
    return [TensorShape(n, DTYPES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]


def key_of(model_dir: Path, **overrides):
    return sidecar.source_key(model_dir, **{**SETTINGS, **overrides})


def write(model_dir: Path, path: Path | None = None, tensors=None, stream=None, **kw):
    tensors = sample_tensors() if tensors is None else tensors
    path = path or sidecar.default_sidecar_path(model_dir, SETTINGS["ranks"])
    key = key_of(model_dir)
    extra = kw.pop("extra", {})
    meta = sidecar.sidecar_metadata(key, model_dir, **extra)
    info = sidecar.write_sidecar(
        path, plan_of(tensors), stream if stream is not None else iter(tensors.items()),
        metadata=meta, **kw,
    )  # fmt: skip
    return path, key, info


def assert_equal_tensors(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        as_bytes = lambda x: x.reshape(-1).view(torch.uint8)  # noqa: E731 - exact, NaN-safe
        assert torch.equal(as_bytes(got[n]), as_bytes(t)), n
