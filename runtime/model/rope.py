"""Rotary position embedding: V4's inverse frequencies (plain, or YaRN-ramped on compressed
layers) and the rotation of each row's trailing channels by them."""

from __future__ import annotations

import math

import torch

from runtime.model.dims import Dims


def rope_inv_freq(d: Dims, compressed: bool, device: torch.device) -> torch.Tensor:
    """Inverse frequencies [rope_dim / 2] on `device` (the positions' own: a constant made on
    the cpu would not meet cuda tensors): plain `rope_theta` on sliding layers; on compressed
    layers `compress_rope_theta`, with YaRN's ramp between extrapolated and interpolated
    frequencies when the config asks for it (cos/sin are not rescaled: V4 uses no mscale)."""
    dim = d.rope_dim
    base = d.compress_rope_theta if compressed else d.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    inv = 1.0 / pos_freqs
    if not compressed or d.rope_factor == 1.0:
        return inv

    def correction_dim(rotations: float) -> float:
        return dim * math.log(d.rope_original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(d.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(d.rope_beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate (low frequencies)
    return (1.0 / (d.rope_factor * pos_freqs)) * (1 - keep) + inv * keep


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of the trailing 2·len(inv_freq) channels by
    position·inv_freq[i] (the inverse rotation with `inverse`); x [S, D] or [S, H, D]."""
    half = inv_freq.shape[0]
    ang = positions.float()[:, None] * inv_freq[None, :]  # [S, half]
    ang = ang.reshape(ang.shape[0], *([1] * (x.dim() - 2)), half)  # broadcast over heads
    cos, sin = ang.cos(), ang.sin()
    if inverse:
        sin = -sin
    keep, r = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    r = r.reshape(*r.shape[:-1], half, 2)
    r0, r1 = r[..., 0], r[..., 1]
    rotated = torch.stack((r0 * cos - r1 * sin, r0 * sin + r1 * cos), dim=-1).flatten(-2)
    return torch.cat((keep, rotated), dim=-1)
