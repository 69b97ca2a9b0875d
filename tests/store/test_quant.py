import pytest
import torch

from store.quant import (
    FP4_VALUES,
    dequant_fp4,
    dequant_fp8_block,
    e8m0_to_float,
    fp4_codes_to_float,
    quant_fp4,
    quant_fp8_block,
    unpack_fp4,
)


def test_e8m0_is_a_bare_exponent():
    raw = torch.tensor([127, 128, 126, 120, 134], dtype=torch.uint8)
    assert e8m0_to_float(raw).tolist() == [1.0, 2.0, 0.5, 2.0**-7, 128.0]
    assert e8m0_to_float(raw.view(torch.float8_e8m0fnu)).tolist() == [1.0, 2.0, 0.5, 2.0**-7, 128.0]


def test_e2m1_value_table():
    assert FP4_VALUES == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    codes = torch.arange(16, dtype=torch.uint8)
    assert fp4_codes_to_float(codes).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def test_fp4_low_nibble_first():
    # byte 0x3A: low nibble 0xA = -1.0 (input 0), high nibble 0x3 = 1.5 (input 1)
    packed = torch.tensor([[0x3A]], dtype=torch.uint8).view(torch.int8)
    assert unpack_fp4(packed).tolist() == [[0xA, 0x3]]
    scale = torch.tensor([[128]], dtype=torch.uint8)  # 2.0, one group covers both inputs
    assert dequant_fp4(packed, scale, group=2).tolist() == [[-2.0, 3.0]]


def test_fp8_block_dequant_hand_computed():
    q = torch.tensor([[1.0, -2.0, 0.5, 3.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[126, 129]], dtype=torch.uint8)  # 0.5 for cols 0-1, 4.0 for cols 2-3
    out = dequant_fp8_block(q, scale, (1, 2))
    assert out.tolist() == [[0.5, -1.0, 2.0, 12.0]]


def test_fp8_roundtrip_within_e4m3_error():
    torch.manual_seed(0)
    w = torch.randn(200, 130) * 0.03
    q, s = quant_fp8_block(w, (64, 64))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 3)
    back = dequant_fp8_block(q, s, (64, 64))
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the value, plus subnormal slack
    slack = e8m0_to_float(s).repeat_interleave(64, 0).repeat_interleave(64, 1)[:200, :130] * 2**-9
    assert ((back - w).abs() <= w.abs() * 2**-4 + slack).all()


def test_fp4_roundtrip_within_half_a_step():
    torch.manual_seed(1)
    w = torch.randn(64, 256) * 0.02
    packed, s = quant_fp4(w)
    assert packed.shape == (64, 128) and packed.dtype == torch.int8 and s.shape == (64, 8)
    back = dequant_fp4(packed, s)
    step = e8m0_to_float(s).repeat_interleave(32, -1)
    # the widest gap in e2m1 is 4 → 6, so the error is at most one scale unit
    assert ((back - w).abs() <= step * 1.0 + 1e-12).all()
    # and the group maximum is represented exactly up to the format's rounding
    assert (back.abs().amax(dim=1) > 0).all()


def test_fp4_rejects_bad_group():
    with pytest.raises(ValueError):
        quant_fp4(torch.zeros(2, 40))


def test_eager_fp8_decode_is_torchs_conversion_for_every_byte():
    """`codes.fp8_float` (a shift and a mask to float16's bits, for the eager engine) against torch's
    own conversion: every byte but the two NaNs exact (subnormals and ±0 included), on a strided
    view too (a weight's column chunk); NaN bytes read ±480, as the native products read them;
    `weight` dequantises with the same decode the same numbers."""
    from runtime.model import codes, ops

    every = torch.arange(256, dtype=torch.uint8)
    nan = (every & 0x7F) == 0x7F
    fp8 = every.view(torch.float8_e4m3fn)
    got = codes.fp8_float(fp8)
    assert torch.equal(got[~nan], fp8.float()[~nan])
    assert torch.equal(torch.signbit(got), torch.signbit(fp8.float()))  # -0.0 stays negative
    assert got[nan].tolist() == [480.0, -480.0]
    grid = every[~nan][torch.randperm(254, generator=torch.Generator().manual_seed(0))][:240]
    q = grid.repeat(8).reshape(64, 30).view(torch.float8_e4m3fn)[:, 2:18]  # not contiguous
    assert torch.equal(codes.fp8_float(q), q.float())
    scale = torch.tensor([[120, 127], [134, 1]], dtype=torch.uint8)
    w = ops.weight({"w.qweight": q, "w.qscale": scale}, "w")
    want = q.float() * torch.exp2(scale.float() - 127).repeat_interleave(32, 0).repeat_interleave(8, 1)
    assert torch.equal(w, want)


def _fp4_weight(inputs, outputs, gen):
    return {"m.qweight": torch.randint(0, 256, (inputs // 2, outputs), dtype=torch.uint8, generator=gen),
            "m.qscale": torch.randint(118, 136, (inputs // 32, outputs), dtype=torch.uint8, generator=gen)}


def _fp8_weight(inputs, outputs, gen):  # every byte, subnormals and NaNs included
    q = torch.randint(0, 256, (inputs, outputs), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    return {"m.qweight": q,
            "m.qscale": torch.randint(110, 140, (inputs // 128, outputs // 128), dtype=torch.uint8, generator=gen)}


@pytest.mark.parametrize(("blocks", "most", "make", "shapes"), [
    ("fp4_blocks", "FP4_BLOCK_ROWS", _fp4_weight, ((256, 96), (2048, 1024))),
    ("fp8_blocks", "FP8_BLOCK_ROWS", _fp8_weight, ((256, 384), (1024, 2048))),
], ids=["fp4", "fp8"])
def test_few_rows_multiply_a_packed_weight_block_by_block(monkeypatch, blocks, most, make, shapes):
    """Eagerly (FP8: on the cpu, no native products loaded), up to FP4_BLOCK_ROWS / FP8_BLOCK_ROWS
    rows times a packed weight go block by block (`fp4_blocks`, `fp8_blocks`: each scale block's
    codes unscaled, its sums scaled), more rows through the whole dequantised weight; both equal
    the product with `weight`'s float32 copy within float32's rounding, a weight split into column
    chunks (a float copy over CHUNK_ELEMENTS: the second shape, two chunks) included, its chunks'
    scale columns their own."""
    from runtime.model import ops

    monkeypatch.setattr(ops, "_native_dense", None)  # as other tests' programs may have left them loaded
    gen = torch.Generator().manual_seed(5)
    calls = []
    real = getattr(ops, blocks)
    monkeypatch.setattr(ops, blocks, lambda w, n, x: calls.append(x.shape[0]) or real(w, n, x))
    few = getattr(ops, most)
    for inputs, outputs in shapes:
        w = make(inputs, outputs, gen)
        want = ops.weight(w, "m")
        for rows in (1, 3, few, few + 1):
            x = torch.randn(rows, inputs, generator=gen)
            got, exact = ops.linear(w, "m", x), x.double() @ want.double()
            assert ((got - exact).abs().max() / exact.abs().max()).item() < 1e-5
    assert calls == [1, 3, few, 1, 1, 3, 3, few, few]  # none of few + 1 rows
