"""DeepSeek V4 weight formats: FP8 e4m3 with E8M0 block scales, FP4 e2m1 with per-32 scales.

Both directions live here: the synthetic generator quantises real float tensors, and the
packer and the reference path dequantise them. E8M0 is a bare exponent byte: 2^(x-127).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0
# e2m1 magnitudes by the low three bits of a code; bit 3 is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Round-to-nearest e2m1 code by floor(4·|x|): every midpoint between neighbours
# (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is a multiple of 1/4, so a 25-entry table decides.
_FP4_BY_QUARTER = (0, 1, 1, 2, 2, 3, 3, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 (as float8_e8m0fnu or uint8 bytes) → float32 powers of two."""
    exp = scale.view(torch.uint8).to(torch.int32) if scale.dtype != torch.uint8 else scale.to(torch.int32)
    return torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp - 127)


def float_to_e8m0(power_of_two: torch.Tensor) -> torch.Tensor:
    """Exact powers of two (float) → float8_e8m0fnu."""
    exp = torch.frexp(power_of_two.float()).exponent - 1 + 127
    return exp.clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= top (ue8m0 scales round up)."""
    amax = amax.clamp(min=2.0**-100)
    return torch.exp2(torch.ceil(torch.log2(amax / top)))


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """Pad a 2-D tensor to whole blocks and view it as [rows_b, br, cols_b, bc]."""
    br, bc = block
    r, c = w.shape
    nr, nc = -(-r // br), -(-c // bc)
    padded = torch.zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:r, :c] = w
    return padded.view(nr, br, nc, bc), (nr, nc)


def quant_fp8_block(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] → (float8_e4m3fn [out, in], E8M0 scale [ceil(out/b0), ceil(in/b1)])."""
    r, c = w.shape
    blocks, _ = _blocks(w.float(), block)
    scale = _pow2_scale(blocks.abs().amax(dim=(1, 3)), FP8_MAX)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(blocks.shape[0] * block[0], blocks.shape[2] * block[1])[:r, :c].contiguous()
    return q, float_to_e8m0(scale)


def dequant_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float8_e4m3fn [out, in] with E8M0 block scales → float32 [out, in]."""
    r, c = q.shape
    s = e8m0_to_float(scale)
    full = s.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)[:r, :c]
    return q.float() * full


def quant_fp4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] → (int8 [out, in/2] two e2m1 codes per byte, low nibble first;
    E8M0 scale [out, in/group])."""
    r, c = w.shape
    if c % group or c % 2:
        raise ValueError(f"FP4 needs the input dim ({c}) to be a multiple of {group}")
    g = w.float().reshape(r, c // group, group)
    scale = _pow2_scale(g.abs().amax(dim=2), FP4_MAX)
    x = (g / scale[..., None]).reshape(r, c)
    quarter = (x.abs() * 4).clamp(max=len(_FP4_BY_QUARTER) - 1).to(torch.uint8).to(torch.int64)
    mag = torch.tensor(_FP4_BY_QUARTER, dtype=torch.uint8)[quarter]
    codes = mag | (((x < 0) & (mag > 0)).to(torch.uint8) << 3)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), float_to_e8m0(scale)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [out, in/2] → uint8 e2m1 codes [out, in] (low nibble is the even input)."""
    b = packed.view(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1)
    return codes.reshape(*b.shape[:-1], b.shape[-1] * 2)


def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=torch.float32)
    return table[codes.to(torch.int64)]


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """int8 packed e2m1 [out, in/2] with E8M0 per-`group` scales → float32 [out, in]."""
    vals = fp4_codes_to_float(unpack_fp4(packed))
    s = e8m0_to_float(scale).repeat_interleave(group, dim=-1)
    return vals * s

