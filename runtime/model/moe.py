"""The MoE: sqrtsoftplus routing (hash or bias), the routed experts (each token's picked
experts; or, eagerly, each expert over the rows that picked it; traced, all of them densely;
chosen per step) with clamped SwiGLU, and the shared expert."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from runtime.model.dims import Dims
from runtime.model.ops import (
    MAX_EXPERT_CHUNKS,
    NativeProducts,
    chunk_units,
    fp4_rows,
    fusing,
    linear,
    weight,
)


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


def _experts_grouped(d: Dims, experts: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor,
                     weights: torch.Tensor, native: NativeProducts | None = None) -> torch.Tensor:
    """Each expert over only the rows that picked it, its weights dequantised once: the routing's
    FLOPs (top-k of E: k/E of the dense path's) and each used expert decoded once (the picked path
    decodes it once per pick). Row counts per expert are data read back to the host, so this runs
    eagerly on the cpu only (a trace holds static shapes; an accelerator would stall on the read:
    there the dense path). Choices outside 0..n-1 (another rank's experts, `routed`) are skipped.
    One expert's float weights at a time, a large one by column chunks (`linear`): the scratch never
    grows with the experts; its matmuls through `ops.matmul`. On `small` (32 experts, top-4, 2
    AMD cores) one layer at 256 rows: 29 ms (44 through MKL), against 149 ms for the dense path
    compiled by inductor. `native`: the FP4 products compiled from C++ (`experts.native`,
    `runtime.model.native`), every used expert's in one call a weight (`_grouped_native`)."""
    n, k = next(iter(experts.values())).shape[0], idx.shape[1]
    flat = idx.reshape(-1)
    pairs = ((flat >= 0) & (flat < n)).nonzero().squeeze(1)  # (row, choice) pairs, as row·k + choice
    by_expert = flat[pairs]
    pairs = pairs[torch.argsort(by_expert, stable=True)]
    counts = torch.bincount(by_expert, minlength=n).tolist()
    rows, gates = pairs // k, weights.reshape(-1)[pairs]
    out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.promote_types(h.dtype, weights.dtype), device=h.device)
    x = h.index_select(0, rows)  # each pair's row, expert by expert
    if native is not None and (y := _grouped_native(d, experts, x, counts, native)) is not None:
        return out.index_add_(0, rows, y * gates[:, None])  # each row's sum in expert order, as below
    ys, start = [], 0
    for e, count in enumerate(counts):
        if count:
            ys.append(expert_ffn(d, {name: t[e] for name, t in experts.items()}, x[start:start + count]))
            start += count
    return out.index_add_(0, rows, torch.cat(ys) * gates[:, None]) if ys else out


def routed_fused(d: Dims, w: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                 expert_base: torch.Tensor | None = None, picked: bool | None = None,
                 native: NativeProducts | None = None) -> torch.Tensor:
    """`routed`, with the native library's fused calls first where they serve: run eagerly on the
    cpu (`experts.native`: the grouped way), a layer's routed experts in two calls
    (`_ffn_native`); anything else as `routed` runs it. Apart from `routed` so the programs that
    trace `routed` (every layer program reaches it by name) keep their keys."""
    if native is not None and h.device.type == "cpu" and not torch.compiler.is_compiling():
        local = idx if expert_base is None else idx - expert_base
        if (y := _ffn_native(d, _expert_tensors(w), h, local, weights, native)) is not None:
            return y
    return routed(d, w, h, idx, weights, expert_base, picked, native)


def _ffn_native(d: Dims, experts: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor,
                weights: torch.Tensor, native: NativeProducts) -> torch.Tensor | None:
    """The whole grouped way of `_experts_grouped` in the native library's two calls a layer
    (`runtime.model.native_ffn`: the sort, gather, products and gate-weighted sum; the SwiGLU
    between them this module's): the same numbers, without the twenty-odd torch ops and three
    calls a layer around them. None where it does not serve (not FP4-packed): the torch ops then."""
    ffn = getattr(native, "ffn", None)
    mats = [(experts.get(f"{name}.qweight"), experts.get(f"{name}.qscale")) for name in EXPERT_MATS]
    if ffn is None or any(q is None or s is None or q.dtype != torch.uint8 for q, s in mats):
        return None
    (p1, q1), (p3, q3), w2 = mats
    return ffn(h, idx, weights, (p1, q1, p3, q3), w2, lambda a, b: _swiglu(d, a, b))


def _grouped_native(d: Dims, experts: dict[str, torch.Tensor], x: torch.Tensor, counts: list[int],
                    native: NativeProducts) -> torch.Tensor | None:
    """`expert_ffn` of every used expert over its rows (x: each expert's rows together, in expert
    order, `counts` of each) in three native calls, one a weight, each one parallel loop over every
    expert's column tiles (threads take the next as they free up, whatever each expert's rows);
    the SwiGLU between them once over all the rows. On `small`, 2 Sapphire Rapids cores, the
    routed experts of one step of 256 rows (8 prompts of 32 tokens), 11 layers: 325 ms called
    expert by expert, 213 ms so; of a lone 32-token prefill 88 ms, 52 so. None when the experts
    are not FP4-packed (or the library refuses them): then expert by expert."""
    ids = [e for e, count in enumerate(counts) if count]
    starts = [0, *itertools.accumulate(counts[e] for e in ids)]

    def product(name: str, rows: torch.Tensor) -> torch.Tensor | None:
        q, scale = experts.get(name + ".qweight"), experts.get(name + ".qscale")
        if q is None or scale is None or q.dtype != torch.uint8:
            return None
        return native.grouped(rows, ids, starts, q, scale)

    if (a := product(EXPERT_MATS[0], x)) is None or (b := product(EXPERT_MATS[1], x)) is None:
        return None
    return product(EXPERT_MATS[2], _swiglu(d, a, b))


def expert_ffn(d: Dims, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One routed expert (its own tensors, no experts dim) over rows x [M, D]: clamped SwiGLU."""
    a, b = (linear(w, name, x) for name in EXPERT_MATS[:2])
    return linear(w, EXPERT_MATS[2], _swiglu(d, a, b))


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
# float weight: it stays the faster way long after the picks outnumber the experts. A lone prefill
# on 2 cores, picked compiled by inductor vs grouped run eagerly (the way the engine runs more rows,
# `runtime.programs.calls`; its matmuls through oneDNN, `ops.matmul`), the whole step, ms: `small`
# (32 experts of 1.57 M weights, top-4) 16 rows 178-192 vs 221-234, 24 rows 253 vs 244, 28 rows
# 243 vs 276, 32 rows 305 vs 260 (medians of 40 steps), 40 rows 406 vs 314, 48 rows 519 vs 334:
# the crossover near 3.5 pairs per expert (6-7 while grouping multiplied through MKL); `tiny` (8
# experts of 98 K weights, top-2) 64 rows 9.2 vs 16.5, 128 rows 17.6 vs 20.0: above 32. Grouping
# an expert costs its decode plus its eager ops, a fixed cost a small expert cannot amortise: the
# limit per expert is FUSED_PICKS_PER_EXPERT + GROUPED_FIXED_WEIGHTS / its weights (small 3.9,
# tiny 32.5, a V4-Flash expert of 44 M weights 2.1). Eagerly, or op by op, the picked path
# dequantises every pick's weights whole and the grouped one each used expert once: grouped is
# never slower (small: 1 row 2.0 vs 1.9 ms, 8 rows 100 vs 10), so an eager step on the cpu always
# groups.
FUSED_PICKS_PER_EXPERT = 2
GROUPED_FIXED_WEIGHTS = 3_000_000


def weights_per_expert(shapes: dict[str, tuple[tuple[int, ...], str]]) -> int:
    """Weights of one routed expert (w1, w3, w2: their qweight or weight, not their scales), from
    each tensor's (shape [experts, …], dtype name): FP4 bytes hold two."""
    return sum(math.prod(shape[1:]) * (2 if dtype == "uint8" else 1) for name, (shape, dtype) in shapes.items()
               if name.endswith((".qweight", ".weight")))


def picks_few(rows, topk, experts, fused: bool = False, expert_weights: int = 0):
    """Do `rows` rows of `topk` choices each pick few enough (row, expert) pairs for only the
    picked experts to run (`_experts_picked`), rather than every expert over its rows? Fewer
    pairs than experts op by op (a traced program's `torch.cond`: there the other way is dense);
    `fused` (compiled by a compiler that fuses: the decode where it multiplies), fewer than
    FUSED_PICKS_PER_EXPERT + GROUPED_FIXED_WEIGHTS / `expert_weights` per expert: the rule by
    which the engine runs the compiled `experts.picked` or the grouped way eagerly
    (`runtime.programs.calls`)."""
    if not fused:
        return rows * topk < experts
    per_expert = FUSED_PICKS_PER_EXPERT + (GROUPED_FIXED_WEIGHTS / expert_weights if expert_weights else 0)
    return rows * topk < int(experts * per_expert)


def routed(d: Dims, w: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
           expert_base: torch.Tensor | None = None, picked: bool | None = None,
           native: NativeProducts | None = None) -> torch.Tensor:
    """Routed experts of rows h [M, D] with their choices idx/weights [M, k]. Run eagerly on the
    cpu: each expert over the rows that picked it (`_experts_grouped`, at most the picked path's
    work at every row count). Traced (a program holds static shapes), or eagerly on an
    accelerator (grouping reads each expert's row count back to the host: free on the cpu, a
    stall of the device's queue in every layer there): the picked experts when the rows' choices
    are few (`picks_few`: more of them when fused), else all of them densely. Traced, the row
    count is symbolic, so both ways are traced and `torch.cond` picks at run time — unless
    `picked` says which way this traced program is (`experts.picked`: a cond costs its program
    several times the compile seconds of one way traced alone).

    Expert parallel (`expert_base` given): `w` holds only this rank's experts, global ids
    expert_base.. expert_base+n-1; choices of other ranks' experts weigh 0 here, so the result
    is this rank's share of each row's sum (the rows came from every rank that picked one of
    these experts; the shares go back to the rows' ranks and are added there).

    `native`: the FP4 products compiled from C++ (`experts.native`) when grouping."""
    experts = _expert_tensors(w)
    n = next(iter(experts.values())).shape[0]
    local = idx if expert_base is None else idx - expert_base
    if h.device.type == "cpu" and not torch.compiler.is_compiling():
        return _experts_grouped(d, experts, h, local, weights, native)  # skips other ranks' choices
    if expert_base is not None:
        weights = torch.where((local >= 0) & (local < n), weights, torch.zeros_like(weights))
        idx = local.clamp(0, n - 1)
    if picked is None:
        size = weights_per_expert({k: (tuple(t.shape), str(t.dtype).removeprefix("torch."))
                                   for k, t in experts.items()})
        few = picks_few(h.shape[0], idx.shape[1], n, fusing(), size)
    else:
        few = picked
    if isinstance(few, bool):
        return (_experts_picked if few else _experts_dense)(d, experts, h, idx, weights)
    names = sorted(experts)

    def branch(fn):
        return lambda h, idx, weights, *tensors: fn(d, dict(zip(names, tensors, strict=True)), h, idx, weights)

    return torch.cond(few, branch(_experts_picked), branch(_experts_dense),
                      (h, idx, weights, *(experts[n] for n in names)))


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
