import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from runtime.model.config import load_config
from runtime.model.tensors import expected_tensors
from store.checkpoint import INDEX_NAME, Checkpoint, CheckpointError, check_contract, family


def _index(root):
    return json.loads((root / INDEX_NAME).read_text())


def _rewrite_index(root, index):
    (root / INDEX_NAME).write_text(json.dumps(index))


def test_lists_without_reading_data_and_reads_lazily(tiny_ckpt_ro):
    ck = Checkpoint.open(tiny_ckpt_ro)
    info = ck.info("layers.0.ffn.experts.0.w1.weight")
    assert (info.dtype, info.shape) == ("I8", (128, 128))
    assert ck._handles == {}  # nothing opened for data yet
    a = ck.read("layers.0.attn.wq_a.weight")
    b = ck.read("layers.0.attn.wq_b.weight")
    assert a.dtype == torch.float8_e4m3fn and b.shape == (256, 128)
    shard = ck.info("layers.0.attn.wq_a.weight").shard
    assert ck.info("layers.0.attn.wq_b.weight").shard == shard
    assert len(ck._handles) == 1  # one handle per shard, reused


def test_missing_dir_config_index(tmp_path, tiny_ckpt):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        Checkpoint.open(tmp_path / "nope")
    (tiny_ckpt / INDEX_NAME).unlink()
    with pytest.raises(CheckpointError, match=f"missing {INDEX_NAME}"):
        Checkpoint.open(tiny_ckpt)
    (tiny_ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        Checkpoint.open(tiny_ckpt)


def test_malformed_index_json(tiny_ckpt):
    (tiny_ckpt / INDEX_NAME).write_text('{"weight_map": ')
    with pytest.raises(CheckpointError, match="malformed JSON"):
        Checkpoint.open(tiny_ckpt)
    (tiny_ckpt / INDEX_NAME).write_text('{"weight_map": [1]}')
    with pytest.raises(CheckpointError, match="'weight_map' must map"):
        Checkpoint.open(tiny_ckpt)


def test_shard_listed_but_absent(tiny_ckpt):
    (tiny_ckpt / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors: shard listed .* is missing"):
        Checkpoint.open(tiny_ckpt)


def test_name_in_index_absent_from_shard(tiny_ckpt):
    index = _index(tiny_ckpt)
    index["weight_map"]["layers.0.attn.ghost.weight"] = "model-00001-of-00003.safetensors"
    _rewrite_index(tiny_ckpt, index)
    with pytest.raises(CheckpointError, match="'layers.0.attn.ghost.weight' is listed .* but absent"):
        Checkpoint.open(tiny_ckpt)


def test_truncated_shard(tiny_ckpt):
    shard = tiny_ckpt / "model-00003-of-00003.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        Checkpoint.open(tiny_ckpt)
    shard.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        Checkpoint.open(tiny_ckpt)


@pytest.mark.parametrize("header", [b"not json at all", b'["list"]', b'{"x": {"dtype": "F32"}}',
                                    b'{"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}'])
def test_corrupt_header(tiny_ckpt, header):
    shard = tiny_ckpt / "model-00001-of-00003.safetensors"
    shard.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        Checkpoint.open(tiny_ckpt)


def test_huge_header_length_is_refused_without_allocating(tiny_ckpt):
    shard = tiny_ckpt / "model-00001-of-00003.safetensors"
    shard.write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        Checkpoint.open(tiny_ckpt)


def test_contract_report_groups_missing_extra_mismatched(tiny_ckpt):
    # rewrite shard 1 without one tensor, with one extra and with one wrong shape
    ck = Checkpoint.open(tiny_ckpt)
    shard = "model-00001-of-00003.safetensors"
    names = [n for n, s in ck.weight_map.items() if s == shard]
    tensors = {n: ck.read(n) for n in names}
    ck.close()
    dropped = "embed.weight"
    assert dropped in tensors
    del tensors[dropped]
    tensors["layers.0.attn.bogus"] = torch.zeros(3)
    tensors["norm.weight"] = torch.zeros(7, dtype=torch.bfloat16)
    save_file(tensors, tiny_ckpt / shard)
    index = _index(tiny_ckpt)
    del index["weight_map"][dropped]
    index["weight_map"]["layers.0.attn.bogus"] = shard
    _rewrite_index(tiny_ckpt, index)
    report = check_contract(Checkpoint.open(tiny_ckpt), expected_tensors(load_config(tiny_ckpt)))
    assert not report.ok
    assert report.missing == (dropped,)
    assert report.extra == ("layers.0.attn.bogus",)
    assert [m.name for m in report.mismatched] == ["norm.weight"]
    assert report.mismatched[0].expected == "BF16[256]" and report.mismatched[0].found == "BF16[7]"
    fams = report.by_family()
    assert fams["embed.weight"] == {"missing": ["embed.weight"]}
    assert fams["layers.N.attn.bogus"] == {"extra": ["layers.0.attn.bogus"]}


def test_family_folds_layer_and_expert_indices():
    assert family("layers.12.ffn.experts.200.w1.scale") == "layers.N.ffn.experts.E.w1.scale"
    assert family("mtp.0.e_proj.weight") == "mtp.N.e_proj.weight"
    assert family("embed.weight") == "embed.weight"
