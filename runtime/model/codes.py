"""The packed formats' codes as values, run eagerly: FP8 (e4m3) and FP4 (e2m1, two codes a byte as
`runtime.weights.pack.serving_fp4` places them) bytes decoded to float16 bit patterns that hold
each value times a power of two, and the E8M0 block scales as float32 factors that fold that power
back in; and, for a traced program to fuse, e2m1 values and the scales as float32 bits made in
integers. `runtime.model.ops` multiplies with them."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch


def fp8_float(q: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 → float32 (eagerly: torch's own conversion on the cpu runs one value at a time). The
    NaN bytes (0x7F, 0xFF) read as ±480, as in the native products."""
    return fp8_float16(q).float().mul_(2.0 ** FP8_CODE_EXP)


# `fp8_float16` writes each e4m3 value · 2^-FP8_CODE_EXP: e4m3's 4-bit exponent (bias 7) placed in
# the low bits of float16's 5-bit one (bias 15), its 3 mantissa bits as float16's top ones, is
# exactly that, subnormals (exponent 0) included; a scale of 2^(byte - 127 + 8) makes it whole.
FP8_CODE_EXP = 8


def fp8_float16(q: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 [..] → float16 [..] holding value · 2^-8, eagerly, in a shift and a mask: the byte
    read as int8 widens to int16 (its sign repeated into bits 8-15), shifted 7 up (exponent and
    mantissa to bits 7-13, the sign to 14 and 15), the mask keeps the sign in 15 and clears 14.
    Then one widening to float32, where the int32 route took four integer passes and a multiply
    (each over 4 bytes a value): a `[1024, 1024]` weight, 2 AMD cores, 1.15 ms dequantised for one
    row before, 0.58 now. Shifted and masked in the widened copy, not into a second buffer: an
    eager decode step of `small` (all its FP8 products), 2 Intel cores, medians of 300 steps a
    form taking turns: 1.6-2.9% faster (packer 2's 115.7 → 113.9 ms, packer 4's 108.5 → 105.3)."""
    c = _decode_constants(q.device)
    out = q.view(torch.int8).to(torch.int16)
    out <<= c.fp8_up
    out &= c.fp8_bits
    return out.view(torch.float16)


# `fp4_float16` writes each code's value · 2^-FP16_CODE_EXP: an e2m1 code (sign, 2-bit exponent
# e, 1-bit mantissa m) placed with e in the low bits of float16's exponent and m as its top
# mantissa bit is exactly that, subnormal codes (e = 0) included. Folding 2^14 into a scale keeps
# every product exact while the scale is below 2^114 (E8M0 byte < 241); a weight beyond that
# overflows float32 at its first product anyway.
FP16_CODE_EXP = 14


def code_scales(scale: torch.Tensor, code_exp: int) -> torch.Tensor:
    """E8M0 scale bytes → float32 factors of codes held as value · 2^-code_exp (`fp4_float16`'s,
    `fp8_float16`'s): 2^(byte - 127 + code_exp). Eagerly as float32 bits, byte + code_exp the
    exponent field: one integer pass (`exp2` takes two, a float copy of the bytes first; small's
    routed experts of a decode step: 1-2 ms). Bytes above 254 - code_exp wrap to ±0 or a tiny
    factor where `exp2` gives inf: either way such a weight overflows float32 at its first product
    (see FP16_CODE_EXP)."""
    if torch.compiler.is_compiling():
        return traced_scales(scale, code_exp)
    c = _decode_constants(scale.device)
    exponent = {FP16_CODE_EXP: c.fp4_exponent, FP8_CODE_EXP: c.fp8_exponent}[code_exp]
    return torch.add(exponent, scale, alpha=1 << 23).view(torch.float32)


class _DecodeConstants(NamedTuple):
    """The eager FP4 and FP8 decodes' integer operands, as tensors of the dtype they meet: a Python
    number costs its op a conversion to a tensor first (~4 µs, of an eager product's ~45 at tiny
    sizes; small's decode step runs 132 products). One element, not 0-dim, where an operand must
    widen the bytes it meets (a 0-dim tensor would leave the result uint8 or int8)."""

    codes_up: torch.Tensor  # int16 [2, 1]: `CODES_UP`
    code_bits: torch.Tensor  # int16, 0-dim: `CODE_BITS`
    fp8_up: torch.Tensor  # int16, 0-dim: FP8_UP (the bytes are widened before it)
    fp8_bits: torch.Tensor  # int16, 0-dim: FP8_BITS
    # int32 [1]: float32's exponent field of 2^FP16_CODE_EXP, of 2^FP8_CODE_EXP
    fp4_exponent: torch.Tensor
    fp8_exponent: torch.Tensor


# the shift taking e4m3's exponent and mantissa (bits 0-6) to float16's bits 7-13, and the mask
# keeping them and the sign (0xBF80 as an int16)
FP8_UP = 7
FP8_BITS = -0x4080


@functools.cache
def _decode_constants(device: torch.device) -> _DecodeConstants:
    """`_DecodeConstants` on `device`, made once (never in a trace: there a constant is a fake one)."""
    i16 = {"dtype": torch.int16, "device": device}
    i32 = {"dtype": torch.int32, "device": device}
    return _DecodeConstants(torch.tensor(CODES_UP, **i16), torch.tensor(CODE_BITS, **i16),
                            torch.tensor(FP8_UP, **i16), torch.tensor(FP8_BITS, **i16),
                            torch.tensor((FP16_CODE_EXP << 23,), **i32), torch.tensor((FP8_CODE_EXP << 23,), **i32))


def fp4_float16(packed: torch.Tensor) -> torch.Tensor:
    """FP4 bytes [.., in/2, out] (`runtime.weights.pack.serving_fp4`'s) → float16 [.., in/2, 2, out]
    (the even input's code, then the odd one's) holding value · 2^-14, in a shift and a mask of the
    bytes: no table, so no index copy. The bytes are read as int8, so widening to int16 repeats bit
    7 (the odd code's sign) in bits 8-15; shifted 9 up, the even code's bits land in 9-11 and its
    sign (bit 6) in 15, shifted 6 up the odd code's in 9-11 and a copy of its sign in 15; the mask
    keeps those. Eagerly both halves at once in one buffer, two passes over it: the checkpoint's
    nibble order took three (a shift further up, then 3 down, so both signs reach bit 15), 14% of
    each eager product of small's experts at one row (2 AMD cores: [1024, 512] 217 -> 186 us)."""
    if torch.compiler.is_compiling():  # no cached constant made in a trace (a fake one)
        w = packed.view(torch.int8).to(torch.int16)
        halves = [(w << shift) & CODE_BITS for (shift,) in CODES_UP]
        return torch.stack(halves, dim=-2).view(torch.float16)
    # the bytes widen to int16 in the shift (the shifts' dtype)
    c = _decode_constants(packed.device)
    out = torch.bitwise_left_shift(packed.view(torch.int8).unsqueeze(-2), c.codes_up)
    out &= c.code_bits
    return out.view(torch.float16)


# the shifts taking the even input's code (bits 0-2) and the odd one's (bits 3-5) to float16's
# bits 9-11, [2, 1]; each takes its sign (bit 6, bit 7 repeated) to bit 15
CODES_UP = ((9,), (6,))


# 0x8E00 as an int16: float16's sign bit, its exponent's two low bits, its top mantissa bit
CODE_BITS = -0x7200


# where a serving FP4 byte (`runtime.weights.pack.serving_fp4`) holds each code's three bits (the
# even input's, the odd one's), and each one's sign bit
CODES_AT = (0, 3)
SIGNS_AT = (0x40, 0x80)


def e2m1(code: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (int32; the low three bits: 2-bit exponent e, 1-bit mantissa m; other bits
    ignored) and their signs (nonzero: negative) → float32 values, for a traced program: their
    float32 bits made in integers (no conversion, no exp2, no table). With c = e·2 + m, |v| =
    (1 + m/2)·2^(e-1) for e ≥ 1 is exponent field e + 126 and top mantissa bit m — (c << 22) +
    (126 << 23) — and m/2 for e = 0 is m times 0.5's bits; the sign goes to bit 31: an integer
    conversion and a multiply fewer a weight than the doubled value's arithmetic it replaces."""
    c = code & 7
    bits = torch.where(c < 2, c * HALF_BITS, (c << 22) + E126_BITS)
    return (bits | ((sign != 0).to(torch.int32) << 31)).view(torch.float32)


# float32's bits of 0.5; exponent field 126, to which (c << 22) adds e
HALF_BITS = 0x3F000000
E126_BITS = 126 << 23


def traced_scales(scale: torch.Tensor, code_exp: int = 0) -> torch.Tensor:
    """E8M0 scale bytes → float32 factors 2^(byte - 127 + code_exp), for a traced program: byte +
    code_exp as float32's exponent field, an add and a shift (`code_scales` does the same eagerly
    with cached operands), where exp2 is a polynomial that inductor evaluates for every weight a
    scale multiplies (fused, not once per block). With `e2m1`'s bits, a `[4, 1024, 512]` chunk
    of small's experts dequantised, compiled, 2 AMD cores: 0.66-0.90 ms → 0.33-0.39 (packer 2's
    int8: 0.46-0.68); one layer's experts compiled, dense at 256 rows, 0.90-0.99× packer 2's →
    0.98-1.11× (`dsv4 bench packing`, eight runs).
    With code_exp 0, byte 255 reads inf as exp2's and byte 0 (2^-127) reads 0: the packer never
    writes it (its scales are at least 2^-102, `store.quant`)."""
    return ((scale.to(torch.int32) + code_exp) << 23).view(torch.float32)
