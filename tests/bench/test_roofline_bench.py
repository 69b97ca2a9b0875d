"""`dsv4 bench roofline` end to end on tiny (eager: no compile): every figure the issue names is in
its JSON, each share is the bound over the measured time, and the least efficient family is named;
the native products timed within a step with the bytes they read."""

from __future__ import annotations

import sys

import pytest
import torch

from bench.roofline_bench import measure, products_timed, tables
from runtime.model.native import load


@pytest.mark.slow
def test_the_roofline_names_every_share_and_the_least_efficient_family():
    r = measure("tiny", "eager", rows=(1, 8), prefills=(16,), repeats=1, steps=1, log=lambda _s: None)
    assert r["bandwidth_gbs"] > 0 and r["triad_gbs"] > 0 and r["cpu"]
    for key in ("decode_share_1", "decode_share_8", "step_8_vs_1", "prefill_share_16"):
        assert r[key] > 0, key
    one, eight = r["decode"][1], r["decode"][8]
    # each figure is rounded apart (share to 4 places, times to the microsecond): equal within that
    assert one["share"] == pytest.approx(one["bound_s"] / one["seconds"], rel=1e-2, abs=1e-4)
    assert one["bound_s"] * r["bandwidth_gbs"] * 1e9 == pytest.approx(one["bytes"], rel=1e-2)  # GB/s rounded
    assert eight["bytes"] > one["bytes"]  # more rows pick more experts and read more KV rows
    assert len(one["experts_picked"]) == 5 and set(one["experts_picked"]) == {2}  # tiny: 5 layers, top-2 a row
    assert one["least_efficient"] in one["families"]
    prefill = r["prefill"][16]
    assert prefill["flops"] > 0 and prefill["gemm_s"] > 0 and prefill["least_efficient"]
    assert tables(r)[0][0].startswith("tiny (eager)")
    made = one["products"]  # eager: the layers' products are no `dsv4::dense` calls
    assert made["seconds"] == pytest.approx(made["dense_s"] + made["experts_s"], abs=2e-6)
    assert r["products_ceiling_1"] == made["ceiling"]
    assert one["rest_s"] == pytest.approx(one["seconds"] - one["engine_s"] - made["seconds"], abs=3e-6)


def test_the_products_timed_are_the_dense_calls_and_the_experts_calls_with_their_weights_bytes(
        native_library, serving, capfd):
    lib = load(native_library)
    serving(lib)  # `dsv4::dense` served by its kernel, as the programs call it
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, 256, generator=gen)
    fp8 = torch.randint(0, 126, (256, 128), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    scale = torch.randint(118, 128, (2, 1), dtype=torch.uint8, generator=gen)
    bf16 = torch.randn(256, 64, generator=gen).bfloat16()

    def stack(n: int, i: int, o: int) -> tuple[torch.Tensor, torch.Tensor]:  # FP4 experts, as packed
        return (torch.randint(0, 256, (n, i // 2, o), dtype=torch.uint8, generator=gen),
                torch.randint(118, 130, (n, i // 32, o), dtype=torch.uint8, generator=gen))

    (w1, s1), (w3, s3), w2 = stack(4, 64, 32), stack(4, 64, 32), stack(4, 32, 64)
    h, idx, gates = torch.randn(3, 64, generator=gen), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2)
    args = (h, idx, gates, (w1, s1, w3, s3), w2, lambda a, b: a * b)
    want = lib.ffn(*args)
    with products_timed(lib) as got:
        dense = torch.ops.dsv4.dense(x, fp8, scale), torch.ops.dsv4.dense(x, bf16, None)
        routed = lib.ffn(*args)
    assert got.dense_calls == 2 and got.dense_bytes == 256 * 128 + 2 + 2 * 256 * 64 and got.dense_s > 0
    assert got.experts_calls == 1 and got.experts_s > 0
    assert torch.equal(routed, want) and torch.equal(dense[0], lib.dense(x, fp8, scale))  # the same numbers
    assert "ffn" not in vars(lib)  # the wrapper is gone: the class's method again
    print("after", file=sys.stderr, flush=True)
    err = capfd.readouterr().err
    assert "profiler" not in err and err.endswith("after\n")  # none of the profiler's lines; stderr back
