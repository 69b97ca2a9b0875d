"""A layer's routed experts in the native library's two calls (`runtime.model.native_ffn`): the
same numbers to the bit as the torch ops around the grouped products they replace (`moe.routed`
with the native products), other ranks'
choices skipped, and a row's numbers whatever rows share its step."""

from __future__ import annotations

import pytest
import test_native
import torch

from runtime.model import moe
from runtime.model.dims import Dims

native = test_native.native  # a fixture: each ISA path of the library built once a session (conftest)


def _layer(experts: int, hidden: int, inter: int, gen) -> dict[str, torch.Tensor]:
    def stack(i: int, o: int):
        packed = torch.randint(0, 256, (experts, i // 2, o), dtype=torch.uint8, generator=gen)
        return packed, torch.randint(118, 130, (experts, i // 32, o), dtype=torch.uint8, generator=gen)

    w = {}
    for name, (i, o) in zip(moe.EXPERT_MATS, ((hidden, inter), (hidden, inter), (inter, hidden)), strict=True):
        w[f"{name}.qweight"], w[f"{name}.qscale"] = stack(i, o)
    return w


def _dims(limit: float = 10.0) -> Dims:
    return Dims(hidden=64, vocab=1, heads=1, head_dim=1, rope_dim=1, q_lora=1, o_lora=1, o_groups=1, window=1,
                experts=6, topk=2, moe_inter=32, routed_scale=1.0, swiglu_limit=limit, norm_topk=True, hc=1,
                sinkhorn_iters=1, hc_eps=1e-6, index_heads=1, index_dim=1, index_topk=1, rope_theta=1.0,
                compress_rope_theta=1.0, max_seq=16)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_the_fused_calls_are_the_torch_ops_numbers_to_the_bit(native, rows):
    gen = torch.Generator().manual_seed(rows)
    d, w = _dims(), _layer(6, 64, 32, gen)
    h = torch.randn(rows, 64, generator=gen)
    idx = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(rows)])
    gates = torch.rand(rows, 2, generator=gen)
    fused = moe.routed_fused(d, w, h, idx, gates, native=native)
    before = moe.routed(d, w, h, idx, gates, native=native)
    assert torch.equal(fused, before)


def test_other_ranks_choices_are_skipped_and_a_rows_numbers_do_not_depend_on_its_neighbours(native):
    gen = torch.Generator().manual_seed(9)
    d, w = _dims(), _layer(6, 64, 32, gen)
    h = torch.randn(12, 64, generator=gen)
    idx = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(12)])
    idx[3, 1], idx[7, 0] = -4, 6  # another rank's experts, below and above this one's
    gates = torch.rand(12, 2, generator=gen)
    got = moe.routed_fused(d, w, h, idx, gates, native=native)
    assert torch.equal(got, moe.routed(d, w, h, idx, gates, native=native))
    for r in (0, 3, 7, 11):
        alone = moe.routed_fused(d, w, h[r:r + 1], idx[r:r + 1], gates[r:r + 1], native=native)
        assert torch.equal(alone, got[r:r + 1])
    nothing = torch.full((2, 2), 6)  # no choice of this rank's: zeros
    assert torch.equal(moe.routed_fused(d, w, h[:2], nothing, gates[:2], native=native), torch.zeros(2, 64))


def test_what_the_fused_calls_cannot_take_falls_back_to_the_torch_ops(native):
    gen = torch.Generator().manual_seed(3)
    w = _layer(6, 64, 32, gen)
    h, idx, gates = torch.randn(4, 64, generator=gen), torch.zeros(4, 2, dtype=torch.int64), torch.rand(4, 2)
    assert native.ffn(h.double(), idx, gates, (w["ffn.experts.w1.qweight"], w["ffn.experts.w1.qscale"],
                      w["ffn.experts.w3.qweight"], w["ffn.experts.w3.qscale"]),
                      (w["ffn.experts.w2.qweight"], w["ffn.experts.w2.qscale"]), lambda a, b: a) is None
    assert native.ffn(h, idx.int(), gates, (w["ffn.experts.w1.qweight"], w["ffn.experts.w1.qscale"],
                      w["ffn.experts.w3.qweight"], w["ffn.experts.w3.qscale"]),
                      (w["ffn.experts.w2.qweight"], w["ffn.experts.w2.qscale"]), lambda a, b: a) is None


def test_a_layers_experts_checked_once_still_follow_their_tensors(native):
    """`Native.ffn` checks a layer's experts once per set of tensors: another layer's tensors, or
    the same tensor objects given other storage, are each multiplied as themselves."""
    gen = torch.Generator().manual_seed(12)
    d = _dims()
    h, idx, gates = torch.randn(3, 64, generator=gen), torch.randint(0, 6, (3, 2), generator=gen), torch.rand(3, 2)
    first, second = _layer(6, 64, 32, gen), _layer(6, 64, 32, gen)
    for w in (first, second, first):
        assert torch.equal(moe.routed_fused(d, w, h, idx, gates, native=native),
                           moe.routed(d, w, h, idx, gates, native=native))
    with torch.no_grad():
        for name, t in first.items():
            t.set_(second[name].clone())  # the same tensors, other bytes
    assert torch.equal(moe.routed_fused(d, first, h, idx, gates, native=native),
                       moe.routed(d, second, h, idx, gates, native=native))
