"""`dsv4 bench roofline --products`' parts: each product called as the service calls it (the same
numbers as the library's checked entries), and the in-cache rate read from one copy only."""

from __future__ import annotations

import pytest
import torch

from bench.products_bench import HOT_BYTES, _hot, _one, _runner
from runtime.model.native import load


@pytest.fixture
def native(native_library, serving):
    lib = load(native_library)
    serving(lib)  # `dsv4::dense` on it for the test, what served before restored after
    return lib


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("name", ["fp8 [1024, 1024]", "fp4 [1024, 512]"])
def test_a_product_runs_as_the_service_calls_it_with_the_checked_entrys_numbers(native, name, rows):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1024, generator=gen)
    run = _runner(native, name, x)
    for _ in range(2):  # the first call makes an FP4 weight's arguments, the second reuses them
        ws = _one(name, gen)
        got = run(ws).clone()
        want = native.grouped(x, [0], [0, rows], *ws) if name.startswith("fp4") else native.dense(x, *ws)
        assert torch.equal(got, want)


def test_the_in_cache_rate_reads_only_the_first_copy_and_skips_a_weight_too_large_to_stay():
    small = [(torch.zeros(64, 64, dtype=torch.uint8), None) for _ in range(5)]
    seen = []
    gbs = _hot(lambda ws: seen.append(ws[0].data_ptr()), small)
    assert gbs > 0 and len(seen) == len(small) + 1  # one warming call, then as many as a pass
    assert set(seen) == {small[0][0].data_ptr()}
    large = [(torch.zeros(HOT_BYTES + 1, dtype=torch.uint8), None)]
    assert _hot(lambda ws: pytest.fail("a weight too large was run"), large) is None
