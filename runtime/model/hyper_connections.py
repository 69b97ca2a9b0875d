"""V4's hyper-connections (mHC): the hc residual streams mixed into a block's input, and the
block's output mixed back into them, through Sinkhorn-normalised combine matrices."""

from __future__ import annotations

import torch

from runtime.model.dims import Dims
from runtime.model.ops import rms_norm


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, then alternate column and row normalisation (columns first)."""
    m = torch.softmax(logits, dim=-1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def hc_pre(d: Dims, w: dict[str, torch.Tensor], which: str, x: torch.Tensor):
    """Hyper-connection mix: X [T, hc, D] → block input [T, D], post weights, combine matrix."""
    t = x.shape[0]
    mix = rms_norm(x.reshape(t, d.hc * d.hidden)) @ w[f"hc_{which}_fn"].float()  # [T, (2+hc)·hc]
    scale, base = w[f"hc_{which}_scale"].float(), w[f"hc_{which}_base"].float()
    hc = d.hc
    pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc]) + d.hc_eps
    post = 2.0 * torch.sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mix[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(t, hc, hc)
    comb = sinkhorn(comb, d.sinkhorn_iters, d.hc_eps)
    inp = (pre[:, :, None] * x).sum(1)
    return inp, post, comb


def hc_post(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: comb^T · X + post ⊗ y (stream k receives Σ_j comb[j, k] · x_j)."""
    return torch.bmm(comb.transpose(1, 2), x) + post[:, :, None] * y[:, None, :]


def hc_head(d: Dims, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    t = x.shape[0]
    mix = rms_norm(x.reshape(t, d.hc * d.hidden)) @ w["hc_head_fn"].float()
    weights = torch.sigmoid(mix * w["hc_head_scale"].float()[0] + w["hc_head_base"].float()) + d.hc_eps
    return (weights[:, :, None] * x).sum(1)
