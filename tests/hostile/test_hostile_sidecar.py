"""Hostile inputs to sidecars and checkpoints (issue 11 items 1, 2, 7): special files where a
sidecar, shard or config is expected, and write targets that are not ours to replace."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hostile_util import SPECIAL_KINDS, make_special, no_hang, one_line
from safetensors.torch import save_file

from console.cli import main as cli
from store import sidecar
from store.checkpoint import CONFIG_NAME, INDEX_NAME, Checkpoint, CheckpointError
from store.errors import UserError

SHARD = "model-00001-of-00001.safetensors"
SETTINGS = {"format": "dsv4-packed-test", "packer_version": "t1", "ranks": 1, "layout": {"tp": 1}}
TENSORS = {"embed.weight": torch.ones(4, 8)}


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / CONFIG_NAME).write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": 8}))
    save_file(TENSORS, d / SHARD)
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": {"embed.weight": SHARD}}))
    return d


def write(model_dir: Path, path: Path, **kw) -> sidecar.SidecarInfo:
    key = sidecar.source_key(model_dir, **SETTINGS)
    plan = [sidecar.TensorShape("embed.weight", "F32", (4, 8))]
    return sidecar.write_sidecar(path, plan, iter(TENSORS.items()),
                                 metadata=sidecar.sidecar_metadata(key, model_dir), **kw)


@pytest.mark.parametrize("kind", SPECIAL_KINDS)
def test_a_special_file_as_sidecar_is_a_corrupt_verdict_never_a_hang(model_dir, kind, capsys):
    path = sidecar.default_sidecar_path(model_dir, 1)
    make_special(path, kind)
    with no_hang():
        verdict = sidecar.inspect(path)
        mapped_verdict, mapped = sidecar.open_sidecar(path)
        code = cli(["sidecar", "status", str(path), "--json"])
    assert verdict.action == sidecar.REPACK and verdict.reason == "corrupt"
    assert "not a regular file" in verdict.detail and "\n" not in verdict.detail
    assert mapped is None and mapped_verdict.reason == "corrupt"
    out = capsys.readouterr()
    if kind == "directory":  # a directory is taken for a checkpoint dir and refused in one line
        assert code == 1 and one_line(out.err)
    else:
        assert code == 0 and json.loads(out.out)["reason"] == "corrupt"


@pytest.mark.parametrize("kind", ["fifo", "device", "socket"])
def test_a_special_file_as_shard_is_one_line_never_a_hang(model_dir, kind):
    (model_dir / SHARD).unlink()
    make_special(model_dir / SHARD, kind)
    with no_hang():
        with pytest.raises(CheckpointError, match="not a regular file") as err:
            Checkpoint.open(model_dir)
        key = sidecar.source_key(model_dir, **SETTINGS)
    assert "\n" not in str(err.value)
    assert key.as_dict()[f"shard:{SHARD}"] == "<not a file>"


@pytest.mark.parametrize("name", [CONFIG_NAME, INDEX_NAME])
def test_a_fifo_as_config_or_index_is_one_line_never_a_hang(model_dir, name):
    (model_dir / name).unlink()
    os.mkfifo(model_dir / name)
    with no_hang():
        with pytest.raises(CheckpointError, match="not a regular file"):
            Checkpoint.open(model_dir)
        with pytest.raises(UserError, match="not a regular file"):
            sidecar.source_key(model_dir, **SETTINGS)


@pytest.mark.parametrize("kind", ["fifo", "device", "socket", "directory"])
def test_a_special_write_target_is_refused_even_with_force(model_dir, tmp_path, kind):
    target = tmp_path / "target"
    make_special(target, kind)
    with no_hang(), pytest.raises(UserError, match="regular file or a new path"):
        write(model_dir, target, force=True)
    assert target.exists() or target.is_socket()


def test_a_symlinked_write_target_is_refused(model_dir, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    os.symlink(victim, tmp_path / "link")
    with pytest.raises(UserError, match="a symlink"):
        write(model_dir, tmp_path / "link", force=True)
    assert victim.read_text() == "keep"


@pytest.mark.parametrize("own", [SHARD, CONFIG_NAME, INDEX_NAME])
def test_the_checkpoints_own_files_are_never_a_write_target(model_dir, own):
    before = (model_dir / own).read_bytes()
    with pytest.raises(UserError, match="checkpoint's own"):
        write(model_dir, model_dir / own, force=True)
    assert (model_dir / own).read_bytes() == before


def test_prepack_out_onto_a_shard_is_one_line_and_the_shard_survives(tiny_ckpt, capsys):
    shard = sorted(tiny_ckpt.glob("model-*.safetensors"))[0]
    before = shard.stat()
    assert cli(["prepack", str(tiny_ckpt), "--out", str(shard), "--force"]) == 1
    err = capsys.readouterr().err
    assert one_line(err) and "checkpoint's own" in err
    after = shard.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
