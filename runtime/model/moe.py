"""The MoE: sqrtsoftplus routing (hash or bias), the routed experts (each token's picked
experts, or all of them densely, chosen per step) with clamped SwiGLU, and the shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime.model.dims import Dims
from runtime.model.ops import MAX_EXPERT_CHUNKS, chunk_units, fp4_rows, fusing, linear, weight


def _swiglu(d: Dims, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a = a.clamp(max=d.swiglu_limit)
    b = b.clamp(-d.swiglu_limit, d.swiglu_limit)
    return F.silu(a) * b


EXPERT_MATS = ("ffn.experts.w1", "ffn.experts.w3", "ffn.experts.w2")


def _expert_tensors(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The routed experts' tensors: packed (qweight + qscale) or float (weight)."""
    names = (n + suffix for n in EXPERT_MATS for suffix in (".qweight", ".qscale", ".weight"))
    return {n: t for n in names if (t := w.get(n)) is not None}


def _experts_dense(d: Dims, experts: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, combined by the routing weights: static-shaped, and the
    cheaper way once the tokens × top-k pick most experts anyway. A few experts at a time are
    dequantised from their packed bytes (at most MAX_EXPERT_CHUNKS chunks), so the float scratch
    is a fraction of one layer's experts, never a copy of them all."""
    n = next(iter(experts.values())).shape[0]
    # added, not set: an expert-parallel rank clamps others' experts onto its own, weight 0
    dense = torch.zeros(h.shape[0], n, dtype=weights.dtype, device=h.device).scatter_add(1, idx, weights)
    one = experts.get("ffn.experts.w2.qweight", experts.get("ffn.experts.w2.weight"))[0]
    per_expert = one.numel() * (2 if one.dtype == torch.uint8 else 1)  # floats: FP4 is two a byte
    step = chunk_units(n, per_expert, most=MAX_EXPERT_CHUNKS)
    out = None
    for e in range(0, n, step):
        part = {k: v[e:e + step] for k, v in experts.items()}
        w1, w3, w2 = (weight(part, name) for name in EXPERT_MATS)  # [step, in, out]
        act = _swiglu(d, torch.einsum("ti,eio->eto", h, w1), torch.einsum("ti,eio->eto", h, w3))
        y = torch.einsum("te,etd->td", dense[:, e:e + step], torch.einsum("eti,eio->eto", act, w2))
        out = y if out is None else out + y
    return out


def _experts_picked(d: Dims, experts: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """Only each token's top-k experts, their weights gathered then dequantised: T·k/E of the
    dense work, what a decode step of few sequences needs."""
    picked = {k: v[idx] for k, v in experts.items()}  # [T, k, …]
    x = h[:, None, :].expand(-1, idx.shape[1], -1)
    act = _swiglu(d, _picked_matmul(x, picked, EXPERT_MATS[0]), _picked_matmul(x, picked, EXPERT_MATS[1]))
    return (_picked_matmul(act, picked, EXPERT_MATS[2]) * weights[..., None]).sum(1)


def _picked_matmul(x: torch.Tensor, picked: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """x [T, k, in] times each row's own weight `name` of `picked` ([T, k, …]). Fused by a
    compiler, as a product summed over the input: one kernel gathers, dequantises and reduces, never storing
    the float weights (3.5× faster than a batched matmul on them; FP4 bytes decoded where they
    multiply, `fp4_rows`); each weight is used once, so nothing is lost."""
    q = picked.get(name + ".qweight")
    if not fusing():  # eager, or a graph run op by op (export)
        return torch.einsum("tki,tkio->tko", x, weight(picked, name))
    if q is not None and q.dtype == torch.uint8:
        return fp4_rows(x, q, picked[name + ".qscale"])
    return (x[..., None] * weight(picked, name)).sum(-2)


# Fused by a compiler, the picked path decodes each pick's bytes where they multiply and stores no
# float weight, while the dense path dequantises every expert into scratch first: picked stays the
# faster way long after the picks outnumber the experts. One layer of `small` (32 experts, top-4),
# compiled by inductor on 2 cores, picked vs dense: 8 rows 4.2 vs 22.6 ms, 16 rows 7.3 vs 19.8,
# 64 rows 44.6 vs 56.4, 96 rows 52.9 vs 70.3, 128 rows 78.0 vs 68.7; `tiny` (8 experts, top-2) is
# even at 128 picks (16 per expert). Run op by op, the picked path dequantises every pick's weights
# whole: on `small` eagerly 8 rows take 152 ms picked vs 59 ms dense, so there one pick per expert.
FUSED_PICKS_PER_EXPERT = 8


def picks_few(rows, topk, experts, fused: bool = False):
    """Do `rows` rows of `topk` choices each pick few enough (row, expert) pairs for only the
    picked experts to run (`_experts_picked`), rather than all of them densely? Fewer pairs than
    experts run op by op; fewer than FUSED_PICKS_PER_EXPERT per expert `fused` (compiled by a
    compiler that fuses: the decode where it multiplies). The one rule for an eager step, a
    traced `torch.cond` (symbolic rows) and the runner that chooses between the two compiled
    expert programs (`runtime.programs.calls`)."""
    return rows * topk < experts * (FUSED_PICKS_PER_EXPERT if fused else 1)


def routed(d: Dims, w: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
           expert_base: torch.Tensor | None = None, picked: bool | None = None) -> torch.Tensor:
    """Routed experts of rows h [M, D] with their choices idx/weights [M, k]: picked when the
    rows' choices are few (`picks_few`: more of them when fused), else dense. The row count is
    known when run eagerly; in a traced program it is symbolic, so both ways are traced and
    `torch.cond` picks at run time — unless `picked` says which way this program is (the
    `experts.picked` and `experts.dense` programs: a cond costs its program several times the
    compile seconds of both ways traced alone).

    Expert parallel (`expert_base` given): `w` holds only this rank's experts, global ids
    expert_base.. expert_base+n-1; choices of other ranks' experts weigh 0 here, so the result
    is this rank's share of each row's sum (the rows came from every rank that picked one of
    these experts; the shares go back to the rows' ranks and are added there)."""
    experts = _expert_tensors(w)
    n = next(iter(experts.values())).shape[0]
    if expert_base is not None:
        local = idx - expert_base
        weights = torch.where((local >= 0) & (local < n), weights, torch.zeros_like(weights))
        idx = local.clamp(0, n - 1)
    few = picks_few(h.shape[0], idx.shape[1], n, fusing()) if picked is None else picked
    if isinstance(few, bool):
        return (_experts_picked if few else _experts_dense)(d, experts, h, idx, weights)
    names = sorted(experts)

    def branch(fn):
        return lambda h, idx, weights, *tensors: fn(d, dict(zip(names, tensors, strict=True)), h, idx, weights)

    return torch.cond(few, branch(_experts_picked), branch(_experts_dense), (h, idx, weights, *(experts[n] for n in names)))


def route(d: Dims, w: dict[str, torch.Tensor], hash_routed: bool, h: torch.Tensor,
          tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k experts (global ids) and their weights [T, k]: sqrtsoftplus scores,
    picked by hash of the token or by score + bias."""
    scores = torch.sqrt(F.softplus(linear(w, "ffn.gate", h)))  # sqrtsoftplus, [T, E]
    if hash_routed:
        idx = w["ffn.gate.tid2eid"][tokens].long()
    else:
        idx = torch.topk(scores + w["ffn.gate.bias"].float(), d.topk, dim=-1).indices
    weights = torch.gather(scores, 1, idx)
    if d.norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return idx, weights * d.routed_scale


def shared_expert(d: Dims, w: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return linear(w, "ffn.shared_experts.w2",
                  _swiglu(d, linear(w, "ffn.shared_experts.w1", h), linear(w, "ffn.shared_experts.w3", h)))


def moe(d: Dims, w: dict[str, torch.Tensor], hash_routed: bool, h: torch.Tensor,
        tokens: torch.Tensor) -> torch.Tensor:
    """The whole MoE of one rank holding every expert: routed + shared."""
    idx, weights = route(d, w, hash_routed, h, tokens)
    return routed(d, w, h, idx, weights) + shared_expert(d, w, h)
