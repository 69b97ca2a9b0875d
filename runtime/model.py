"""DeepSeek V4 forward pass: one set of block functions, two weight views.

The numerics follow the V4 block structure (DSV4_CHECKPOINT.md) as a *structural reference*:
no official outputs exist to compare with, so they are not claimed to match DeepSeek's
kernels. What is claimed, and tested: the packed path equals the unpacked reference path
(float weights dequantised straight from the checkpoint) within int8 rounding; compiled
programs equal eager; decoding after a prefill equals one longer prefill.

Weights reach the block functions as a flat dict keyed by packed family names relative to
their group ("attn.wq_a.qweight", "ffn.experts.w1.qscale", "attn_norm.weight"). The packed
view holds int8 [in, out] + fp32 per-row scales; the reference view holds float [in, out]
under "<family>.weight". `linear` serves both.

Caches are fixed-size per layer ([max_seq, …] rows indexed by position), so every program
has static shapes except the token count T. A program returns the new cache rows; the caller
writes them (programs stay pure). Compressed KV entries are recomputed from per-token
compressor inputs each step: O(max_seq) work that keeps prefill and decode the same math.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from runtime.config import CSA, HCA, SLIDING
from runtime.dims import Dims, cache_shapes  # noqa: F401 - torch-free, shared with the launch plan

NORM_EPS = 1e-6


# ---- building blocks -----------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return y if weight is None else y * weight.float()


def linear(w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """x @ W for a packed (int8 + per-row scale) or a float weight, both stored [in, out]."""
    q = w.get(name + ".qweight")
    if q is not None:
        return (x @ q.float()) * w[name + ".qscale"].float()
    return x @ w[name + ".weight"].float()


def _matrix(w: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    q = w.get(name + ".qweight")
    if q is not None:
        return q.float(), w[name + ".qscale"].float()
    return w[name + ".weight"].float(), None


def rope(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float) -> torch.Tensor:
    """Rotary embedding on the last `rope_dim` dims; x [S, D] or [S, H, D], positions [S]."""
    half = rope_dim // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float32) / half))
    ang = positions.float()[:, None] * inv[None, :]  # [S, half]
    ang = ang.reshape(ang.shape[0], *([1] * (x.dim() - 2)), half)  # broadcast over heads
    cos, sin = ang.cos(), ang.sin()
    keep, r = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim:]
    r1, r2 = r[..., :half], r[..., half:]
    return torch.cat((keep, r1 * cos - r2 * sin, r1 * sin + r2 * cos), dim=-1)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def hc_pre(d: Dims, w: dict[str, torch.Tensor], which: str, x: torch.Tensor):
    """Hyper-connection mix: X [T, hc, D] → block input [T, D], post weights, combine matrix."""
    t = x.shape[0]
    mix = rms_norm(x.reshape(t, d.hc * d.hidden)) @ w[f"hc_{which}_fn"].float()  # [T, (2+hc)·hc]
    scale, base = w[f"hc_{which}_scale"].float(), w[f"hc_{which}_base"].float()
    hc = d.hc
    pre = torch.sigmoid(mix[:, :hc] * scale[0] + base[:hc])
    post = 2.0 * torch.sigmoid(mix[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mix[:, 2 * hc:] * scale[2] + base[2 * hc:]).reshape(t, hc, hc)
    comb = sinkhorn(comb, d.sinkhorn_iters, d.hc_eps)
    inp = (pre[:, :, None] * x).sum(1)
    return inp, post, comb


def hc_post(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return torch.bmm(comb, x) + post[:, :, None] * y[:, None, :]


def hc_head(d: Dims, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    t = x.shape[0]
    mix = rms_norm(x.reshape(t, d.hc * d.hidden)) @ w["hc_head_fn"].float()
    weights = torch.sigmoid(mix * w["hc_head_scale"].float()[0] + w["hc_head_base"].float())
    return (weights[:, :, None] * x).sum(1)


# ---- attention -----------------------------------------------------------------------------

def _scatter_rows(cache: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return cache.index_copy(0, positions, rows.to(cache.dtype))


def compress(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """Gated pooling of `ratio` tokens per entry; CSA also pools the previous block (overlap).

    kv, gate: [S, width]; ape: [ratio, width] → entries [S/ratio, width or width/2]."""
    s, width = kv.shape
    nb = s // ratio
    kv = kv.float().reshape(nb, ratio, width)
    g = gate.float().reshape(nb, ratio, width) + ape.float()[None]
    if not overlap:
        return (torch.softmax(g, dim=1) * kv).sum(1)
    dim = width // 2
    # entry b pools block b (first half of channels) and block b-1 (second half)
    prev_kv = torch.cat((torch.zeros_like(kv[:1, :, dim:]), kv[:-1, :, dim:]), 0)
    prev_g = torch.cat((torch.full_like(g[:1, :, dim:], -1e30), g[:-1, :, dim:]), 0)
    both_kv = torch.cat((prev_kv, kv[:, :, :dim]), 1)
    both_g = torch.cat((prev_g, g[:, :, :dim]), 1)
    return (torch.softmax(both_g, dim=1) * both_kv).sum(1)


def attention(d: Dims, w: dict[str, torch.Tensor], kind: str, ratio: int, h: torch.Tensor,
              positions: torch.Tensor, cache: dict[str, torch.Tensor]):
    t, s = h.shape[0], d.max_seq
    qa = rms_norm(linear(w, "attn.wq_a", h), w["attn.q_norm.weight"])
    q = linear(w, "attn.wq_b", qa).reshape(t, d.heads, d.head_dim)
    q = rope(q, positions, d.rope_dim, d.rope_theta)
    kv_new = rms_norm(linear(w, "attn.wkv", h), w["attn.kv_norm.weight"])  # [T, hd]
    rows = {"kv": kv_new}
    all_pos = torch.arange(s, dtype=positions.dtype)
    kv = _scatter_rows(cache["kv"], positions, kv_new).float()
    k = rope(kv, all_pos, d.rope_dim, d.rope_theta)
    scale = 1.0 / math.sqrt(d.head_dim)
    visible = (all_pos[None, :] <= positions[:, None]) & (all_pos[None, :] > positions[:, None] - d.window)
    logits = torch.einsum("thd,sd->ths", q, k) * scale
    logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
    parts_logits, parts_values = [logits], [("ths,sd->thd", kv)]
    if kind in (CSA, HCA):
        overlap = kind == CSA
        ckv_new, cgate_new = linear(w, "attn.compressor.wkv", h), linear(w, "attn.compressor.wgate", h)
        rows.update(ckv=ckv_new, cgate=cgate_new)
        ckv = _scatter_rows(cache["ckv"], positions, ckv_new)
        cgate = _scatter_rows(cache["cgate"], positions, cgate_new)
        entries = rms_norm(compress(ckv, cgate, w["attn.compressor.ape"], ratio, overlap),
                           w["attn.compressor.norm.weight"])  # [NB, hd]
        nb = s // ratio
        block_end = (torch.arange(nb, dtype=positions.dtype) + 1) * ratio - 1
        c_visible = block_end[None, :] <= positions[:, None]  # [T, NB]
        if kind == CSA:
            ikv_new = linear(w, "attn.indexer.compressor.wkv", h)
            igate_new = linear(w, "attn.indexer.compressor.wgate", h)
            rows.update(ikv=ikv_new, igate=igate_new)
            ikv = _scatter_rows(cache["ikv"], positions, ikv_new)
            igate = _scatter_rows(cache["igate"], positions, igate_new)
            ikeys = rms_norm(compress(ikv, igate, w["attn.indexer.compressor.ape"], ratio, True),
                             w["attn.indexer.compressor.norm.weight"])  # [NB, id]
            iq = linear(w, "attn.indexer.wq_b", qa).reshape(t, d.index_heads, d.index_dim)
            iw = linear(w, "attn.indexer.weights_proj", h)  # [T, iH]
            score = (torch.relu(torch.einsum("thd,bd->thb", iq, ikeys)) * iw[:, :, None]).sum(1)
            score = score.masked_fill(~c_visible, float("-inf"))
            top = torch.topk(score, min(d.index_topk, nb), dim=-1).indices  # [T, K]
            selected = entries[top]  # [T, K, hd]
            sel_visible = torch.gather(c_visible, 1, top)
            c_logits = torch.einsum("thd,tkd->thk", q, selected) * scale
            c_logits = c_logits.masked_fill(~sel_visible[:, None, :], float("-inf"))
            parts_logits.append(c_logits)
            parts_values.append(("thk,tkd->thd", selected))
        else:
            c_logits = torch.einsum("thd,bd->thb", q, entries) * scale
            c_logits = c_logits.masked_fill(~c_visible[:, None, :], float("-inf"))
            parts_logits.append(c_logits)
            parts_values.append(("thb,bd->thd", entries))
    sink = w["attn.attn_sink"].float()[None, :, None].expand(t, d.heads, 1)
    # one softmax over window keys, compressed entries and the sink; then each part's values
    probs = torch.softmax(torch.cat([*parts_logits, sink], dim=-1), dim=-1)
    out, start = 0, 0
    for part_logits, (equation, values) in zip(parts_logits, parts_values, strict=True):
        width = part_logits.shape[-1]
        out = out + torch.einsum(equation, probs[..., start:start + width], values)
        start += width
    # grouped low-rank output: each of o_groups head groups has its own wo_a slice
    k_in = d.heads * d.head_dim // d.o_groups
    wa, sa = _matrix(w, "attn.wo_a")
    o = torch.einsum("tgk,kgo->tgo", out.reshape(t, d.o_groups, k_in), wa.reshape(k_in, d.o_groups, d.o_lora))
    if sa is not None:
        o = o * sa.reshape(d.o_groups, d.o_lora)
    return linear(w, "attn.wo_b", o.reshape(t, d.o_groups * d.o_lora)), rows


# ---- MoE -----------------------------------------------------------------------------------

def _swiglu(d: Dims, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a = a.clamp(max=d.swiglu_limit)
    b = b.clamp(-d.swiglu_limit, d.swiglu_limit)
    return F.silu(a) * b


def _experts_linear(w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """All experts at once: x [T, in] or [E, T, in] → [E, T, out]."""
    m, s = _matrix(w, name)  # [E, in, out], [E, out]
    y = torch.einsum("ti,eio->eto", x, m) if x.dim() == 2 else torch.einsum("eti,eio->eto", x, m)
    return y if s is None else y * s[:, None, :]


def moe(d: Dims, w: dict[str, torch.Tensor], hash_routed: bool, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    scores = torch.sqrt(F.softplus(linear(w, "ffn.gate", h)))  # sqrtsoftplus, [T, E]
    if hash_routed:
        idx = w["ffn.gate.tid2eid"][tokens].long()
    else:
        idx = torch.topk(scores + w["ffn.gate.bias"].float(), d.topk, dim=-1).indices
    weights = torch.gather(scores, 1, idx)
    if d.norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * d.routed_scale
    dense = torch.zeros_like(scores).scatter(1, idx, weights)  # [T, E]
    # dense over experts: simple and static-shaped, right for these model sizes
    act = _swiglu(d, _experts_linear(w, "ffn.experts.w1", h), _experts_linear(w, "ffn.experts.w3", h))
    routed = torch.einsum("te,etd->td", dense, _experts_linear(w, "ffn.experts.w2", act))
    shared = linear(w, "ffn.shared_experts.w2",
                    _swiglu(d, linear(w, "ffn.shared_experts.w1", h), linear(w, "ffn.shared_experts.w3", h)))
    return routed + shared


# ---- blocks and programs -------------------------------------------------------------------

def block(d: Dims, kind: str, ratio: int, hash_routed: bool, w: dict[str, torch.Tensor],
          x: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
          cache: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One transformer block on the hc residual stream X [T, hc, D]."""
    inp, post, comb = hc_pre(d, w, "attn", x)
    y, rows = attention(d, w, kind, ratio, rms_norm(inp, w["attn_norm.weight"]), positions, cache)
    x = hc_post(x, y, post, comb)
    inp, post, comb = hc_pre(d, w, "ffn", x)
    y = moe(d, w, hash_routed, rms_norm(inp, w["ffn_norm.weight"]), tokens)
    return hc_post(x, y, post, comb), rows


def embed(d: Dims, w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    h = w["embed.weight"][tokens].float()
    return h[:, None, :].expand(h.shape[0], d.hc, d.hidden).contiguous()


def head(d: Dims, w: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hc residual → (logits [T, V], pre-norm hidden [T, D] that the MTP layer consumes)."""
    h = hc_head(d, w, x)
    return linear(w, "head", rms_norm(h, w["norm.weight"])), h


def mtp_input(d: Dims, w: dict[str, torch.Tensor], emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """MTP: e_proj(enorm(embed(next token))) + h_proj(hnorm(h)), spread to hc copies."""
    x = linear(w, "e_proj", rms_norm(emb.float(), w["enorm.weight"])) + \
        linear(w, "h_proj", rms_norm(h, w["hnorm.weight"]))
    return x[:, None, :].expand(x.shape[0], d.hc, d.hidden).contiguous()


KINDS = (SLIDING, CSA, HCA)
