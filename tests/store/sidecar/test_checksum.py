"""Sidecar data is checkable (issue 11 item 4): per-chunk checksums written by the writer,
checked by `dsv4 sidecar verify` and `warm`; a header that differs from the packed layout is REPACK."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from console.cli import main as cli
from store import sidecar
from store.checkpoint import CONFIG_NAME, INDEX_NAME
from store.sidecar import checksum

SHARD = "model-00001-of-00001.safetensors"
SETTINGS = {"format": "dsv4-packed-test", "packer_version": "t1", "ranks": 1, "layout": {"tp": 1}}
CHUNK = checksum.CHUNK_BYTES


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # "big" spans several chunks; "small" and "tail" share the last one with big's end.
    return {"big": torch.rand(3 * CHUNK // 4 + 100, generator=g), "small": torch.arange(10, dtype=torch.int32),
            "tail": torch.rand(7, generator=g).to(torch.bfloat16)}


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / CONFIG_NAME).write_text(json.dumps({"model_type": "deepseek_v4"}))
    save_file({"w": torch.ones(2)}, d / SHARD)
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": SHARD}}))
    return d


def plan(ts: dict[str, torch.Tensor]) -> list[sidecar.TensorShape]:
    names = {torch.float32: "F32", torch.int32: "I32", torch.bfloat16: "BF16"}
    return [sidecar.TensorShape(n, names[t.dtype], tuple(t.shape)) for n, t in ts.items()]


def write(model_dir: Path) -> Path:
    path = sidecar.default_sidecar_path(model_dir, 1)
    key = sidecar.source_key(model_dir, **SETTINGS)
    ts = tensors()
    sidecar.write_sidecar(path, plan(ts), iter(ts.items()), metadata=sidecar.sidecar_metadata(key, model_dir))
    return path


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def data_start(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_a_fresh_sidecar_verifies_every_chunk_and_still_loads_with_safetensors(model_dir, capsys):
    path = write(model_dir)
    result = checksum.verify_file(path)
    data = path.stat().st_size - data_start(path)
    assert result.ok and result.chunks == checksum.chunk_count(data) == 4
    assert set(load_file(path)) == set(tensors())
    assert cli(["sidecar", "verify", str(model_dir)]) == 0
    assert "4 chunks verified" in capsys.readouterr().out


def test_a_flipped_byte_names_the_tensors_of_its_chunk(model_dir, capsys):
    path = write(model_dir)
    flip(path, path.stat().st_size - 3)  # in the last chunk: big's end, small and tail
    result = checksum.verify_file(path)
    assert not result.ok and [i for i, _ in result.bad] == [3]
    assert result.bad[0][1] == ("big", "small", "tail")
    assert cli(["sidecar", "verify", str(path), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["verified"] is False and out["bad_chunks"] == [{"chunk": 3, "tensors": ["big", "small", "tail"]}]


def test_a_zeroed_data_region_fails_every_chunk_though_the_header_is_sound(model_dir):
    path = write(model_dir)
    start = data_start(path)
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(b"\0" * (path.stat().st_size - start))
    assert sidecar.inspect(path).action == sidecar.MAP  # the header alone cannot tell
    result = checksum.verify_file(path)
    assert [i for i, _ in result.bad] == [0, 1, 2, 3]


def test_warm_verifies_while_it_reads_and_fails_on_a_bad_chunk(model_dir, capsys):
    path = write(model_dir)
    assert cli(["sidecar", "warm", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["verify"]["verified"] is True and out["bytes_read"] == path.stat().st_size
    flip(path, data_start(path) + 5)
    assert cli(["sidecar", "warm", str(path)]) == 1
    out = capsys.readouterr().out
    assert "NOT verified" in out and "tensors: big" in out
    assert cli(["sidecar", "warm", str(path), "--no-verify", "--json"]) == 0
    assert "verify" not in json.loads(capsys.readouterr().out)


def test_a_sidecar_without_checksums_says_so_in_one_line(model_dir, capsys):
    ts = {"x": torch.ones(4)}
    path = model_dir / "plain.safetensors"
    save_file(ts, path)
    assert cli(["sidecar", "verify", str(path)]) == 1
    out = capsys.readouterr()
    assert "\n" not in (out.out + out.err).strip()


def test_a_header_whose_shapes_differ_from_the_plan_is_repack_naming_the_tensor(model_dir):
    path = write(model_dir)
    key = sidecar.source_key(model_dir, **SETTINGS)
    want = [p if p.name != "small" else sidecar.TensorShape("small", "I32", (5, 2)) for p in plan(tensors())]
    verdict = sidecar.inspect(path, expected_key=key, expected_tensors=want)
    assert verdict.action == sidecar.REPACK and verdict.reason == "shapes"
    assert "small is I32[10], the layout says I32[5, 2]" in verdict.detail
    other = [p if p.name != "tail" else sidecar.TensorShape("tail", "F16", (7,)) for p in plan(tensors())]
    got, mapped = sidecar.open_sidecar(path, expected_key=key, expected_tensors=other)
    assert mapped is None and got.reason == "shapes" and "tail is BF16[7]" in got.detail
    ok = sidecar.inspect(path, expected_key=key, expected_tensors=plan(tensors()))
    assert ok.action == sidecar.MAP


def test_warm_events_end_with_the_verification(model_dir, tmp_path):
    path = write(model_dir)
    events = tmp_path / "events.jsonl"
    assert cli(["sidecar", "warm", str(path), "--events", str(events)]) == 0
    end = [json.loads(line) for line in events.read_text().splitlines()][-1]
    assert end["kind"] == "end" and end["detail"]["verified"] is True and end["detail"]["verified_at"]
    assert "chunks verified" in end["message"]
