"""Packing rules: every family's packed form equals the dequantised checkpoint tensor."""

import pytest
import torch

from runtime.model.config import load_config
from runtime.model.forward import weight
from runtime.model.tensors import all_params
from runtime.weights.pack import (
    RULES,
    PackedLayout,
    dequantize,
    pack_in_memory,
    rule_for,
    serving_fp4,
)
from store.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def packed(tiny_ckpt_ro):
    ck = Checkpoint.open(tiny_ckpt_ro)
    config = load_config(tiny_ckpt_ro)
    layout = PackedLayout(config, ranks=2)
    return ck, config, layout, pack_in_memory(ck, layout)


def test_every_checkpoint_parameter_has_exactly_one_rule(packed):
    _, config, layout, _ = packed
    assert set(layout.slots) == {p.name for p in all_params(config)}
    used = {s.rule for s in layout.slots.values()}
    assert used == set(RULES)  # no dead rows in the table


def test_the_layout_matches_the_packed_tensors(packed):
    _, _, layout, tensors = packed
    assert set(tensors) == layout.names()
    dt = {"I8": torch.int8, "F32": torch.float32, "BF16": torch.bfloat16, "I32": torch.int32,
          "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn}
    for name, t in layout.tensors.items():
        assert tuple(tensors[name].shape) == t.shape and tensors[name].dtype == dt[t.dtype], name


def _unpacked(tensors, slot):
    return [tensors[n][slot.index] for n in slot.names]


@pytest.mark.parametrize(("name", "qdtype", "block"), [
    ("layers.2.attn.wq_a.weight", torch.float8_e4m3fn, (32, 32)),   # FP8, all layers
    ("mtp.0.e_proj.weight", torch.float8_e4m3fn, (32, 32)),         # FP8, MTP
    ("layers.4.attn.indexer.wq_b.weight", torch.float8_e4m3fn, (32, 32)),  # FP8, CSA group
    ("layers.1.ffn.experts.6.w2.weight", torch.uint8, (32, 1)),      # FP4, rank-major experts
    ("mtp.0.ffn.experts.3.w1.weight", torch.uint8, (32, 1)),         # FP4, MTP experts
])
def test_packed_blocks_are_the_checkpoint_weight_exactly(packed, name, qdtype, block):
    """No requantisation: the packed codes with their E8M0 block scales dequantise to exactly
    the checkpoint's float weight; the bytes are the checkpoint's, transposed whole (FP4: two
    codes a byte, so [in/2, out], their bits placed by `serving_fp4`)."""
    ck, config, layout, tensors = packed
    p = next(p for p in all_params(config) if p.name == name)
    q, scale = _unpacked(tensors, layout.slots[name])
    assert q.dtype == qdtype and scale.dtype == torch.uint8
    inputs = q.shape[0] * (2 if qdtype == torch.uint8 else 1)
    assert scale.shape == (inputs // block[0], q.shape[1] // block[1])
    stored = ck.read(name).view(torch.uint8).t()
    assert torch.equal(q.view(torch.uint8), serving_fp4(stored) if qdtype == torch.uint8 else stored)
    assert torch.equal(scale, ck.read(p.scale_name).view(torch.uint8).t())
    back = weight({"m.qweight": q, "m.qscale": scale}, "m").t()
    assert torch.equal(back, dequantize(ck, config, p))


def test_expert_slot_is_rank_major(packed):
    _, config, layout, _ = packed
    per_rank = config.n_routed_experts // 2
    slot = layout.slots["layers.3.ffn.experts.5.w2.weight"]
    assert slot.index == (5 // per_rank, 3, 5 % per_rank)
    assert layout.tensors["layers.ffn.experts.w2.qweight"].shape[:3] == (2, config.num_hidden_layers, per_rank)


def test_plain_families(packed):
    ck, _config, layout, tensors = packed
    gate = _unpacked(tensors, layout.slots["layers.1.ffn.gate.weight"])[0]
    assert torch.equal(gate, ck.read("layers.1.ffn.gate.weight").t())
    tid = _unpacked(tensors, layout.slots["layers.1.ffn.gate.tid2eid"])[0]
    assert tid.dtype == torch.int32 and torch.equal(tid.long(), ck.read("layers.1.ffn.gate.tid2eid"))
    bias = _unpacked(tensors, layout.slots["layers.2.ffn.gate.bias"])[0]
    assert torch.equal(bias, ck.read("layers.2.ffn.gate.bias"))
    assert layout.slots["layers.2.ffn.gate.bias"].index == (0,)  # first score-routed layer
    hca = _unpacked(tensors, layout.slots["layers.3.attn.compressor.wkv.weight"])[0]
    assert torch.equal(hca, ck.read("layers.3.attn.compressor.wkv.weight").t())
    assert torch.equal(tensors["head.weight"], ck.read("head.weight").t())


def test_packing_is_deterministic(packed, tiny_ckpt_ro):
    _ck, config, _plan, tensors = packed
    again = pack_in_memory(Checkpoint.open(tiny_ckpt_ro), PackedLayout(config, ranks=2))
    for n in tensors:
        assert torch.equal(tensors[n].view(torch.uint8), again[n].view(torch.uint8)), n


def test_weights_not_in_whole_blocks_are_refused_at_plan_time():
    """One scale per block needs whole blocks; a config that breaks that is one clear error
    from the (torch-free) layout, before anything is read or written."""
    from runtime.model.config import ConfigError, from_dict
    from runtime.synth.checkpoint import preset_config_dict

    raw = preset_config_dict("tiny")
    raw["quantization_config"]["weight_block_size"] = [48, 48]
    with pytest.raises(ConfigError, match="not whole blocks of 48x48"):
        PackedLayout(from_dict(raw))


def test_unknown_family_has_no_rule():
    with pytest.raises(KeyError):
        rule_for("attn.new_thing.weight")


def test_ranks_must_divide_experts(tiny_ckpt_ro):
    from runtime.model.config import ConfigError

    with pytest.raises(ConfigError):
        PackedLayout(load_config(tiny_ckpt_ro), ranks=3)
