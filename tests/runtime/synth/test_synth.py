import hashlib

import pytest
import torch

from runtime.model.config import load_config
from runtime.model.tensors import expected_tensors
from runtime.synth.checkpoint import (
    PRESETS,
    V4_FLASH,
    preset_config,
    preset_config_dict,
    synth_param,
    synthesize,
)
from store.checkpoint import Checkpoint, check_contract
from store.errors import UserError
from store.quant import dequant_fp4, dequant_fp8_block


def _digests(root):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir())}


def test_same_preset_and_seed_gives_byte_identical_files(tiny_ckpt_ro, tmp_path):
    again = synthesize("tiny", tmp_path / "again", seed=0)
    assert _digests(again) == _digests(tiny_ckpt_ro)
    other = synthesize("tiny", tmp_path / "other", seed=1)
    assert _digests(other)["model-00001-of-00003.safetensors"] != \
        _digests(tiny_ckpt_ro)["model-00001-of-00003.safetensors"]


def test_tensor_bytes_do_not_depend_on_shard_count(tiny_ckpt_ro, tmp_path):
    two = Checkpoint.open(synthesize("tiny", tmp_path / "two", seed=0, shards=2))
    three = Checkpoint.open(tiny_ckpt_ro)
    assert len(set(two.weight_map.values())) == 2
    for name in ("layers.2.attn.wq_a.weight", "layers.4.ffn.experts.7.w2.scale", "mtp.0.e_proj.weight"):
        assert torch.equal(two.read(name).view(torch.uint8), three.read(name).view(torch.uint8))


def test_tiny_is_small_and_passes_its_contract(tiny_ckpt_ro):
    size = sum(p.stat().st_size for p in tiny_ckpt_ro.iterdir())
    assert size <= 16 * 1024 * 1024
    ckpt = Checkpoint.open(tiny_ckpt_ro)
    report = check_contract(ckpt, expected_tensors(load_config(tiny_ckpt_ro)))
    assert report.ok, report.to_json()
    assert len(ckpt.shard_paths()) == 3


def test_real_names_dtypes_and_formats(tiny_ckpt_ro):
    ck = Checkpoint.open(tiny_ckpt_ro)
    c = load_config(tiny_ckpt_ro)
    t = ck.tensors
    assert t["layers.0.attn.wq_a.weight"].dtype == "F8_E4M3"
    assert t["layers.0.attn.wq_a.scale"].dtype == "F8_E8M0"
    assert t["layers.0.ffn.experts.0.w1.weight"].dtype == "I8"
    assert t["layers.0.ffn.experts.0.w1.weight"].shape == (c.moe_intermediate_size, c.hidden_size // 2)
    assert t["layers.0.ffn.experts.0.w1.scale"].shape == (c.moe_intermediate_size, c.hidden_size // 32)
    assert "layers.0.ffn.gate.tid2eid" in t and "layers.0.ffn.gate.bias" not in t
    assert "layers.2.ffn.gate.bias" in t and "layers.2.ffn.gate.tid2eid" not in t
    assert "layers.2.attn.indexer.wq_b.weight" in t  # CSA
    assert "layers.3.attn.compressor.wkv.weight" in t and "layers.3.attn.indexer.wq_b.weight" not in t  # HCA
    assert t["layers.2.attn.compressor.wkv.weight"].shape == (2 * c.head_dim, c.hidden_size)
    assert t["layers.3.attn.compressor.wkv.weight"].shape == (c.head_dim, c.hidden_size)
    assert "layers.0.attn.compressor.wkv.weight" not in t  # sliding
    for n in ("mtp.0.e_proj.weight", "mtp.0.enorm.weight", "mtp.0.hc_head_fn", "embed.weight", "head.weight"):
        assert n in t
    tid = ck.read("layers.0.ffn.gate.tid2eid")
    assert tid.dtype == torch.int64 and int(tid.max()) < c.n_routed_experts
    assert all(len(set(row)) == len(row) for row in tid[:50].tolist())


def test_weights_are_quantisations_of_float_tensors(tiny_ckpt_ro):
    """Dequantising a stored weight gives back the generator's float tensor within format error."""
    from runtime.model.tensors import all_params

    c = load_config(tiny_ckpt_ro)
    ck = Checkpoint.open(tiny_ckpt_ro)
    params = {p.name: p for p in all_params(c)}
    torch_gen = torch.Generator()
    for name in ("layers.1.attn.wkv.weight", "layers.1.ffn.experts.3.w2.weight"):
        p = params[name]
        from runtime.synth.checkpoint import _generator

        torch_gen = _generator(0, name)
        x = torch.randn(p.shape, generator=torch_gen) / (p.shape[-1] ** 0.5)
        w, s = ck.read(name), ck.read(p.scale_name)
        back = dequant_fp8_block(w, s, c.fp8_block) if p.fmt == "fp8" else dequant_fp4(w, s)
        rel = ((back - x).norm() / x.norm()).item()
        assert rel < (0.05 if p.fmt == "fp8" else 0.2), (name, rel)
        assert not torch.equal(back, torch.zeros_like(back))
    assert synth_param(c, params["layers.0.attn_norm.weight"], 0)["layers.0.attn_norm.weight"].dtype == torch.bfloat16


def test_refuses_non_empty_dir_without_force(tiny_ckpt, tmp_path):
    with pytest.raises(UserError, match="not empty; pass --force"):
        synthesize("tiny", tiny_ckpt)
    (tiny_ckpt / "notes.txt").write_text("keep me")
    synthesize("tiny", tiny_ckpt, force=True, shards=2)
    assert (tiny_ckpt / "notes.txt").read_text() == "keep me"
    assert len(list(tiny_ckpt.glob("model-*.safetensors"))) == 2  # old 3-shard files are gone


def _header_only_checkpoint(root, raw_config):
    from bench.plan_bench import header_only_checkpoint
    from runtime.model.config import from_dict

    return from_dict(raw_config), header_only_checkpoint(root, raw_config)


@pytest.mark.slow
@pytest.mark.parametrize("preset", [*PRESETS, "v4-flash"])
def test_contract_holds_on_every_preset_layout(tmp_path, preset):
    raw = V4_FLASH if preset == "v4-flash" else preset_config_dict(preset)
    c, nbytes = _header_only_checkpoint(tmp_path / "m", raw)
    report = check_contract(Checkpoint.open(tmp_path / "m"), expected_tensors(c))
    assert report.ok
    if preset == "v4-flash":
        assert 140e9 < nbytes < 170e9  # ~160 GB like the released checkpoint
    if preset == "small":
        assert 0.3e9 < nbytes < 0.8e9


def test_preset_config_matches_file(tiny_ckpt_ro):
    assert load_config(tiny_ckpt_ro) == preset_config("tiny")
