"""`dsv4 bench roofline` end to end on tiny (eager: no compile): every figure the issue names is in
its JSON, each share is the bound over the measured time, and the least efficient family is named."""

from __future__ import annotations

import pytest

from bench.roofline_bench import measure, tables


@pytest.mark.slow
def test_the_roofline_names_every_share_and_the_least_efficient_family():
    r = measure("tiny", "eager", rows=(1, 8), prefills=(16,), repeats=1, steps=1, log=lambda _s: None)
    assert r["bandwidth_gbs"] > 0 and r["triad_gbs"] > 0 and r["cpu"]
    for key in ("decode_share_1", "decode_share_8", "step_8_vs_1", "prefill_share_16"):
        assert r[key] > 0, key
    one, eight = r["decode"][1], r["decode"][8]
    assert one["share"] == round(one["bound_s"] / one["seconds"], 4)
    assert one["bound_s"] * r["bandwidth_gbs"] * 1e9 == pytest.approx(one["bytes"], rel=1e-2)  # GB/s rounded
    assert eight["bytes"] > one["bytes"]  # more rows pick more experts and read more KV rows
    assert len(one["experts_picked"]) == 5 and set(one["experts_picked"]) == {2}  # tiny: 5 layers, top-2 a row
    assert one["least_efficient"] in one["families"]
    prefill = r["prefill"][16]
    assert prefill["flops"] > 0 and prefill["gemm_s"] > 0 and prefill["least_efficient"]
    assert tables(r)[0][0].startswith("tiny (eager)")
