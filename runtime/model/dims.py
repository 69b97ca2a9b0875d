"""Every size and constant the model's math uses, and its per-layer cache rows: torch-free,
so program signatures and keys (runtime.program_specs, the launch plan) need no torch."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from runtime.model.config import CSA, HCA, DeepSeekV4Config

# KV slots a service asks for (fewer when memory is short): the most sequences one decode step
# batches. Programs take up to MAX_SLOTS (`--max-slots`, runtime.launch.spec, is bounded by it).
MAX_SLOTS = 4096


@dataclass(frozen=True)
class Dims:
    """Every size and constant the math uses (model dims + the runtime's max_seq)."""

    hidden: int
    vocab: int
    heads: int
    head_dim: int
    rope_dim: int
    q_lora: int
    o_lora: int
    o_groups: int
    window: int
    experts: int
    topk: int
    moe_inter: int
    routed_scale: float
    swiglu_limit: float
    norm_topk: bool
    hc: int
    sinkhorn_iters: int
    hc_eps: float
    index_heads: int
    index_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    max_seq: int
    # YaRN of the compressed layers' RoPE (rope_factor 1.0: none); sliding layers never scale
    rope_factor: float = 1.0
    rope_original_max: int = 0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0

    @classmethod
    def of(cls, c: DeepSeekV4Config, max_seq: int) -> Dims:
        ratios = [r for r in c.compress_ratios if r]
        lcm = math.lcm(*ratios) if ratios else 1
        if max_seq % lcm:
            raise ValueError(f"max_seq={max_seq} must be a multiple of every compress ratio (lcm {lcm})")
        rs = c.rope_scaling or {}
        yarn = ()
        if rs.get("type", rs.get("rope_type")) == "yarn":  # config.py refuses any other kind
            yarn = (float(rs["factor"]), int(rs["original_max_position_embeddings"]),
                    float(rs.get("beta_fast") or 32), float(rs.get("beta_slow") or 1))
        return cls(c.hidden_size, c.vocab_size, c.num_attention_heads, c.head_dim, c.qk_rope_head_dim,
                   c.q_lora_rank, c.o_lora_rank, c.o_groups, c.sliding_window, c.n_routed_experts,
                   c.num_experts_per_tok, c.moe_intermediate_size, c.routed_scaling_factor,
                   c.swiglu_limit, c.norm_topk_prob, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps,
                   c.index_n_heads, c.index_head_dim, c.index_topk, c.rope_theta,
                   c.compress_rope_theta, max_seq, *yarn)

    def to_json(self) -> dict:
        return asdict(self)


# Caches indexed by compressed window (entry b at row b) rather than by token position
WINDOW_CACHES = ("entries", "ikeys")


def cache_shapes(d: Dims, kind: str, ratio: int) -> dict[str, tuple[int, ...]]:
    """Per-layer, per-slot cache rows (name → [rows, width]); programs return new rows by name.

    Per token: the rotated KV head, and the compressors' inputs. Per compressed window (ratio
    tokens): the finished entries, normed and rotated, computed once when the window completes."""
    shapes = {"kv": (d.max_seq, d.head_dim)}
    if kind == CSA:
        nb = d.max_seq // ratio
        shapes.update(ckv=(d.max_seq, 2 * d.head_dim), cgate=(d.max_seq, 2 * d.head_dim),
                      ikv=(d.max_seq, 2 * d.index_dim), igate=(d.max_seq, 2 * d.index_dim),
                      entries=(nb, d.head_dim), ikeys=(nb, d.index_dim))
    elif kind == HCA:
        shapes.update(ckv=(d.max_seq, d.head_dim), cgate=(d.max_seq, d.head_dim),
                      entries=(d.max_seq // ratio, d.head_dim))
    return shapes
