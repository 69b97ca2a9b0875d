"""DeepSeek V4 forward pass: one set of block functions, two weight views.

The numerics follow DeepSeek V4's conventions and are proven against an independent
implementation: on the same float32 weights, prefill and cached decode logits and every
layer's residual stream equal Hugging Face transformers' `DeepseekV4ForCausalLM` to float
rounding (tests/test_parity.py). The conventions that matter, each one a place where a
plausible reading of the architecture computes a different model:

- RoPE rotates adjacent pairs (2i, 2i+1) of the trailing `rope_dim` channels. Sliding-window
  layers use `rope_theta` unscaled; compressed (CSA/HCA) layers and their indexer use
  `compress_rope_theta` with the config's YaRN (no attention-factor rescaling of cos/sin).
- The query gets a per-head RMS normalisation (no weight) after `wq_b`.
- The single KV head, after RoPE, is both key and value; the attention output's rope part is
  rotated back (inverse rotation at the query position) before the grouped output projection.
- Compressed entries get RoPE at their window's first position. CSA's overlapping compressor
  pools the current window through the second half of the projected channels and the previous
  window through the first half (the indexer's compressor too). The indexer's queries and keys
  are rotated like the attention's.
- Hyper-connections: pre weights are sigmoid + hc_eps; the combine matrix is a row softmax +
  hc_eps, then Sinkhorn normalisation starting with the columns, and mixes the residual
  streams transposed (stream k receives Σ_j comb[j, k] · x_j).
- MTP (no transformers counterpart): e_proj(enorm(embed(next token))) + h_proj(hnorm(x)) per
  residual stream, where x is the main model's last hc residual stream, before its head.

Weights reach the block functions as a flat dict keyed by packed family names relative to
their group ("attn.wq_a.qweight", "ffn.experts.w1.qscale", "attn_norm.weight"). The packed
view holds the checkpoint's quantised bytes in the matmul layout (FP8 as stored [in, out], FP4
two codes a byte [in/2, out]) with one E8M0 scale byte per block, dequantised here; the
reference view holds float [in, out] under "<family>.weight". `weight` serves both, so both compute the same model.

Caches are fixed-size per layer and slot ([slots, max_seq, …] rows indexed by position; the
finished compressed entries [slots, max_seq/ratio, …] by window), so every program has static
shapes except the row count and the slot count. A step's rows (`Rows`) each name their slot
and position: a prefill is one sequence's tokens, a decode step packs rows of many sequences.
A program returns the new cache rows; the caller writes them (programs stay pure).

Incremental compressed KV: a compressed entry is computed once, by the row that completes its
window (from that window's compressor inputs, O(ratio)), and kept; a decode row reads the
sliding window's keys and the finished entries, never max_seq rows. A prefill recomputes its
sequence's entries from the rows (once per prompt, the same pooling).
"""

from __future__ import annotations

import torch

from runtime.model.attention import Rows, attention
from runtime.model.config import CSA, HCA, SLIDING
from runtime.model.dims import Dims
from runtime.model.hyper_connections import hc_head, hc_post, hc_pre
from runtime.model.moe import moe, route, routed_fused, shared_expert
from runtime.model.ops import NORM_EPS, NativeProducts, linear, rms_norm, weight

__all__ = ["FFN_PARTS", "KINDS", "NORM_EPS", "ROUTED_INPUT", "Rows", "block", "embed", "experts", "ffn_out", "head",
           "mtp_input", "weight"]


def block(d: Dims, kind: str, ratio: int, hash_routed: bool, w: dict[str, torch.Tensor],
          x: torch.Tensor, tokens: torch.Tensor, rows: Rows, cache: dict[str, torch.Tensor],
          prefill: bool, expert_parallel: bool = False):
    """One transformer block on the hc residual stream X [T, hc, D]; returns (the new X, the
    new cache rows). Expert parallel, the block stops before its routed experts: it returns the
    FFN_PARTS instead of X (the routed experts' input rows and choices go to the ranks that own
    those experts, and `ffn_out` finishes the block with the shares they send back)."""
    inp, post, comb = hc_pre(d, w, "attn", x)
    y, new_rows = attention(d, w, kind, ratio, rms_norm(inp, w["attn_norm.weight"]), rows, cache, prefill)
    x = hc_post(x, y, post, comb)
    inp, post, comb = hc_pre(d, w, "ffn", x)
    h = rms_norm(inp, w["ffn_norm.weight"])
    if expert_parallel:
        idx, weights = route(d, w, hash_routed, h, tokens)
        return (x, post, comb, h, idx, weights, shared_expert(d, w, h)), new_rows
    return hc_post(x, moe(d, w, hash_routed, h, tokens), post, comb), new_rows


# (x, post, comb, routed input h, expert ids, weights, shared expert): an expert-parallel block's parts
FFN_PARTS = 7
ROUTED_INPUT = slice(3, 6)  # (h, idx, weights): what goes to the experts' owners


def ffn_out(parts: tuple[torch.Tensor, ...], routed: torch.Tensor) -> torch.Tensor:
    """An expert-parallel block's output, once `routed` holds every owner's share of its rows."""
    x, post, comb, *_, shared = parts
    return hc_post(x, routed + shared, post, comb)


def experts(d: Dims, w: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
            expert_base: torch.Tensor | None, picked: bool | None = None,
            native: NativeProducts | None = None) -> torch.Tensor:
    """This rank's routed experts over rows from any rank (their choices of other ranks'
    experts weigh 0 here): each row's share of its routed sum (`expert_base` None: one rank
    holding every expert); `picked`: only that way; `native`: the FP4 products (`moe.routed`), a
    layer's experts in two native calls where they serve (`moe.routed_fused`)."""
    return routed_fused(d, w, h, idx, weights, expert_base, picked, native)


def embed(d: Dims, w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    h = w["embed.weight"][tokens].float()
    return h[:, None, :].expand(h.shape[0], d.hc, d.hidden).contiguous()


def head(d: Dims, w: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """hc residual → (logits [T, V], the collapsed pre-norm hidden [T, D])."""
    h = hc_head(d, w, x)
    return linear(w, "head", rms_norm(h, w["norm.weight"])), h


def mtp_input(d: Dims, w: dict[str, torch.Tensor], emb: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """MTP input streams: e_proj(enorm(embed(next token))) + h_proj(hnorm(h)) per stream, where
    h [T, hc, D] is the main model's last hc residual stream (before its head)."""
    e = linear(w, "e_proj", rms_norm(emb.float(), w["enorm.weight"]))  # [T, D]
    return e[:, None, :] + linear(w, "h_proj", rms_norm(h.float(), w["hnorm.weight"]))


KINDS = (SLIDING, CSA, HCA)
