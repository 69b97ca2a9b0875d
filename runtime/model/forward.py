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
view holds the checkpoint's quantised numbers [in, out] (FP8 as stored, FP4 as doubled int8
codes) with one E8M0 scale byte per block, dequantised here; the reference view holds float
[in, out] under "<family>.weight". `weight` serves both, so both compute the same model.

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

import math

import torch
import torch.nn.functional as F

from runtime.config import CSA, HCA, SLIDING
from runtime.dims import Dims

NORM_EPS = 1e-6


# ---- building blocks -----------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)
    return y if weight is None else y * weight.float()


def weight(w: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A matmul weight [.., in, out] as float32: a packed one dequantised per block from the
    checkpoint's numbers (qweight · 2^(qscale - 127), qscale one E8M0 byte per block), or a float
    one as is. Block sizes follow from the shapes: the packer stores whole blocks only."""
    q = w.get(name + ".qweight")
    if q is None:
        return w[name + ".weight"].float()
    e = w[name + ".qscale"]
    *lead, i, o = q.shape
    gi, go = e.shape[-2], e.shape[-1]
    scale = torch.exp2(e.float() - 127.0).reshape(*lead, gi, 1, go, 1)
    return (q.float().reshape(*lead, gi, i // gi, go, o // go) * scale).reshape(*lead, i, o)


# A weight whose float copy would be larger than this is dequantised and multiplied a few output
# columns at a time. One float copy of small's output head is 128 MiB, allocated afresh (and
# page-faulted) on every call: 5× the matmul itself; a chunk of a few MiB is reused from the
# allocator and stays in cache. At most MAX_CHUNKS, so a traced program stays small: more chunks in the
# routed experts' dense path halved its time but doubled small's cold compile, so it has none.
CHUNK_ELEMENTS = 1 << 20
MAX_CHUNKS = 16


def _chunk(count: int, unit_elements: int, align: int = 1) -> int:
    """Units (of `unit_elements` floats each) per chunk of `count`: about CHUNK_ELEMENTS floats,
    at most MAX_CHUNKS chunks, a multiple of `align`."""
    size = max(CHUNK_ELEMENTS // unit_elements, -(-count // MAX_CHUNKS), 1)
    return -(-size // align) * align


def linear(w: dict[str, torch.Tensor], name: str, x: torch.Tensor) -> torch.Tensor:
    """x @ W for a packed or a float weight, both stored [in, out]; a large one by column chunks."""
    q, scale = w.get(name + ".qweight"), w.get(name + ".qscale")
    i, o = (w[name + ".weight"] if q is None else q).shape[-2:]
    block = 1 if q is None else o // scale.shape[-1]  # output columns per scale block
    step = _chunk(o, i, block)
    if step >= o:
        return x @ weight(w, name)

    def columns(c: int) -> dict[str, torch.Tensor]:  # output columns c..c+step, whole scale blocks
        if q is None:
            return {name + ".weight": w[name + ".weight"][..., c:c + step]}
        return {name + ".qweight": q[..., c:c + step], name + ".qscale": scale[..., c // block:(c + step) // block]}

    return torch.cat([x @ weight(columns(c), name) for c in range(0, o, step)], dim=-1)


def rope_inv_freq(d: Dims, compressed: bool) -> torch.Tensor:
    """Inverse frequencies [rope_dim / 2]: plain `rope_theta` on sliding layers; on compressed
    layers `compress_rope_theta`, with YaRN's ramp between extrapolated and interpolated
    frequencies when the config asks for it (cos/sin are not rescaled: V4 uses no mscale)."""
    dim = d.rope_dim
    base = d.compress_rope_theta if compressed else d.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv = 1.0 / pos_freqs
    if not compressed or d.rope_factor == 1.0:
        return inv

    def correction_dim(rotations: float) -> float:
        return dim * math.log(d.rope_original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(d.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(d.rope_beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
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


# ---- attention ----------------------------------------------------------------------------

def compress(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """Gated pooling of `ratio` tokens per entry; CSA also pools the previous window (overlap).

    kv, gate: [S, width]; ape: [ratio, width] → entries [S/ratio, width or width/2]. With
    overlap, entry b pools window b through channels [dim:] and window b-1 through [:dim]."""
    s, width = kv.shape
    nb = s // ratio
    kv = kv.float().reshape(nb, ratio, width)
    g = gate.float().reshape(nb, ratio, width) + ape.float()[None]
    if not overlap:
        return (torch.softmax(g, dim=1) * kv).sum(1)
    dim = width // 2
    prev_kv = torch.cat((torch.zeros_like(kv[:1, :, :dim]), kv[:-1, :, :dim]), 0)
    prev_g = torch.cat((torch.full_like(g[:1, :, :dim], float("-inf")), g[:-1, :, :dim]), 0)
    both_kv = torch.cat((prev_kv, kv[:, :, dim:]), 1)
    both_g = torch.cat((prev_g, g[:, :, dim:]), 1)
    return (torch.softmax(both_g, dim=1) * both_kv).sum(1)


class Rows:
    """Where a step's rows live: row i is token `positions[i]` of the sequence in cache slot
    `slots[i]`, whose new rows in this step start at position `starts[i]` (a slot's rows are
    consecutive). A prefill is one slot's rows; a decode step packs one or more rows per slot."""

    def __init__(self, positions: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor):
        self.positions, self.slots, self.starts = positions, slots, starts
        self.index = torch.arange(positions.shape[0], device=positions.device)

    def at(self, cache: torch.Tensor, new: torch.Tensor, q: torch.Tensor, cache_index: torch.Tensor | None = None) -> torch.Tensor:
        """Rows at positions q [T, K] of each row's own sequence → [T, K, width]: this step's
        new row there (new[i] is at positions[i]) from the slot's start on, else the cached row
        (cache [slots, N, width] read at `cache_index`, default q). Positions past a row's own
        are whatever is there: callers mask them."""
        idx = (q if cache_index is None else cache_index).clamp(0, cache.shape[1] - 1)
        old = cache[self.slots[:, None], idx]
        fresh = new[(self.index[:, None] + q - self.positions[:, None]).clamp(0, new.shape[0] - 1)]
        return torch.where((q >= self.starts[:, None])[..., None], fresh.to(old.dtype), old)

    def slot_rows(self, cache: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """A prefill's one slot: its cached rows [N, width] with this step's rows written in."""
        return cache[self.slots[:1]][0].index_copy(0, self.positions, new.to(cache.dtype))


def window_entries(rows: Rows, cache_kv: torch.Tensor, cache_gate: torch.Tensor, kv_new: torch.Tensor,
                   gate_new: torch.Tensor, ape: torch.Tensor, ratio: int, overlap: bool) -> torch.Tensor:
    """Each row's compressed entry of its own window (and, with overlap, the window before) from
    the rows so far: O(ratio) per row, complete when the row ends its window. [T, width']"""
    span = (2 if overlap else 1) * ratio
    first = (rows.positions // ratio) * ratio - (span - ratio)
    q = first[:, None] + torch.arange(span, device=first.device)[None, :]  # [T, span]
    kv, gate = rows.at(cache_kv, kv_new, q), rows.at(cache_gate, gate_new, q)
    before = (q < 0)[..., None]  # the window before the first: nothing to pool (as in `compress`)
    kv, gate = kv.masked_fill(before, 0.0), gate.masked_fill(before, float("-inf"))
    entries = compress(kv.reshape(-1, kv.shape[-1]), gate.reshape(-1, gate.shape[-1]), ape, ratio, overlap)
    return entries[1::2] if overlap else entries  # with overlap, each row's second window is its own


def compressed(d: Dims, w: dict[str, torch.Tensor], prefix: str, ratio: int, overlap: bool, h: torch.Tensor,
               rows: Rows, cache: dict[str, torch.Tensor], names: tuple[str, str, str], inv_freq: torch.Tensor,
               prefill: bool, out: dict[str, torch.Tensor]) -> torch.Tensor:
    """A compressor's entries as the attention reads them, and the cache rows it adds to `out`.

    Per-token compressor inputs are kept as rows (names[0], names[1]); entries (names[2]) are
    computed once, when their window completes, and kept. A decode row computes its own
    window's entry (O(ratio)) and reads the others from the cache → per-row entries
    [T, NB, width]. A prefill recomputes its slot's entries from the rows (O(max_seq), once per
    prompt) → shared entries [NB, width]; the caller writes them all back."""
    kv_name, gate_name, entry_name = names
    kv_new, gate_new = linear(w, f"{prefix}.wkv", h), linear(w, f"{prefix}.wgate", h)
    out.update({kv_name: kv_new, gate_name: gate_new})
    ape, norm = w[f"{prefix}.ape"], w[f"{prefix}.norm.weight"]
    if prefill:
        pooled = compress(rows.slot_rows(cache[kv_name], kv_new), rows.slot_rows(cache[gate_name], gate_new),
                          ape, ratio, overlap)
        nb = pooled.shape[0]
        entries = rope(rms_norm(pooled, norm), torch.arange(nb, device=h.device) * ratio, inv_freq)
        out[entry_name] = entries
        return entries
    new = window_entries(rows, cache[kv_name], cache[gate_name], kv_new, gate_new, ape, ratio, overlap)
    new = rope(rms_norm(new, norm), (rows.positions // ratio) * ratio, inv_freq)  # at the window's start
    out[entry_name] = new  # the caller keeps the rows that complete their window
    nb = cache[entry_name].shape[1]
    window = torch.arange(nb, device=h.device)
    ends = (window * ratio + ratio - 1)[None, :].expand(h.shape[0], nb)  # the position completing each
    return rows.at(cache[entry_name], new, ends, window[None, :].expand_as(ends))


def _scores(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T, H, D] · entries shared [NB, D] or per row [T, NB, D] → [T, H, NB]."""
    return torch.einsum("thd,bd->thb" if b.dim() == 2 else "thd,tbd->thb", a, b)


def attention(d: Dims, w: dict[str, torch.Tensor], kind: str, ratio: int, h: torch.Tensor,
              rows: Rows, cache: dict[str, torch.Tensor], prefill: bool):
    t = h.shape[0]
    positions = rows.positions
    inv_freq = rope_inv_freq(d, compressed=kind != SLIDING)
    qa = rms_norm(linear(w, "attn.wq_a", h), w["attn.q_norm.weight"])
    q = rms_norm(linear(w, "attn.wq_b", qa).reshape(t, d.heads, d.head_dim))  # per-head norm
    q = rope(q, positions, inv_freq)
    # the single KV head, rotated, is both key and value; cache rows hold it rotated
    kv_new = rope(rms_norm(linear(w, "attn.wkv", h), w["attn.kv_norm.weight"]), positions, inv_freq)
    out_rows = {"kv": kv_new}
    # the sliding window: each row reads only its window's `window` keys, never max_seq of them
    win = positions[:, None] + torch.arange(1 - d.window, 1, device=h.device)[None, :]  # [T, W]
    keys = rows.at(cache["kv"], kv_new, win)  # [T, W, hd]
    scale = 1.0 / math.sqrt(d.head_dim)
    logits = torch.einsum("thd,tsd->ths", q, keys) * scale
    logits = logits.masked_fill(~(win >= 0)[:, None, :], float("-inf"))
    parts_logits, parts_values = [logits], [keys]
    if kind in (CSA, HCA):
        overlap = kind == CSA
        entries = compressed(d, w, "attn.compressor", ratio, overlap, h, rows, cache, ("ckv", "cgate", "entries"),
                             inv_freq, prefill, out_rows)  # [NB, hd] or [T, NB, hd]
        nb = entries.shape[-2]
        c_visible = (torch.arange(nb, device=h.device) * ratio + ratio - 1)[None, :] <= positions[:, None]  # [T, NB]
        if kind == CSA:
            ikeys = compressed(d, w, "attn.indexer.compressor", ratio, True, h, rows, cache, ("ikv", "igate", "ikeys"),
                               inv_freq, prefill, out_rows)
            iq = linear(w, "attn.indexer.wq_b", qa).reshape(t, d.index_heads, d.index_dim)
            iq = rope(iq, positions, inv_freq)
            iw = linear(w, "attn.indexer.weights_proj", h) * d.index_heads ** -0.5  # [T, iH]
            score = torch.relu(_scores(iq, ikeys)) * d.index_dim ** -0.5
            score = (score * iw[:, :, None]).sum(1)
            score = score.masked_fill(~c_visible, float("-inf"))
            top = torch.topk(score, min(d.index_topk, nb), dim=-1).indices  # [T, K]
            if entries.dim() == 2:
                selected = entries[top]  # [T, K, hd]
            else:
                selected = torch.gather(entries, 1, top[..., None].expand(-1, -1, entries.shape[-1]))
            c_logits = torch.einsum("thd,tkd->thk", q, selected) * scale
            c_logits = c_logits.masked_fill(~torch.gather(c_visible, 1, top)[:, None, :], float("-inf"))
            parts_logits.append(c_logits)
            parts_values.append(selected)
        else:
            c_logits = _scores(q, entries) * scale
            parts_logits.append(c_logits.masked_fill(~c_visible[:, None, :], float("-inf")))
            parts_values.append(entries)
    sink = w["attn.attn_sink"].float()[None, :, None].expand(t, d.heads, 1)
    # one softmax over window keys, compressed entries and the sink; then each part's values
    probs = torch.softmax(torch.cat([*parts_logits, sink], dim=-1), dim=-1)
    out, start = 0, 0
    for part_logits, values in zip(parts_logits, parts_values, strict=True):
        width = part_logits.shape[-1]
        p = probs[..., start:start + width]
        out = out + torch.einsum("thb,bd->thd" if values.dim() == 2 else "thb,tbd->thd", p, values)
        start += width
    out = rope(out, positions, inv_freq, inverse=True)  # values carried their keys' rotation
    # grouped low-rank output: each of o_groups head groups has its own wo_a slice
    k_in = d.heads * d.head_dim // d.o_groups
    wa = weight(w, "attn.wo_a").reshape(k_in, d.o_groups, d.o_lora)
    o = torch.einsum("tgk,kgo->tgo", out.reshape(t, d.o_groups, k_in), wa)
    return linear(w, "attn.wo_b", o.reshape(t, d.o_groups * d.o_lora)), out_rows


# ---- MoE -----------------------------------------------------------------------------------

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
    cheaper way once the tokens × top-k pick most experts anyway."""
    w1, w3, w2 = (weight(experts, n) for n in EXPERT_MATS)  # [E, in, out]
    # added, not set: an expert-parallel rank clamps others' experts onto its own, weight 0
    dense = torch.zeros(h.shape[0], w1.shape[0], dtype=weights.dtype, device=h.device).scatter_add(1, idx, weights)
    act = _swiglu(d, torch.einsum("ti,eio->eto", h, w1), torch.einsum("ti,eio->eto", h, w3))
    return torch.einsum("te,etd->td", dense, torch.einsum("eti,eio->eto", act, w2))


def _experts_picked(d: Dims, experts: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
    """Only each token's top-k experts, their weights gathered then dequantised: T·k/E of the
    dense work, what a decode step of few sequences needs."""
    picked = {k: v[idx] for k, v in experts.items()}  # [T, k, …]
    w1, w3, w2 = (weight(picked, n) for n in EXPERT_MATS)  # [T, k, in, out]
    x = h[:, None, :].expand(-1, idx.shape[1], -1)
    act = _swiglu(d, _picked_matmul(x, w1), _picked_matmul(x, w3))
    return (_picked_matmul(act, w2) * weights[..., None]).sum(1)


def _picked_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, k, in] times each row's own w [T, k, in, out]. Compiled, as a product summed over the
    input: one kernel gathers, dequantises and reduces, never storing the float weights (3.5×
    faster than a batched matmul on them); each weight is used once, so nothing is lost."""
    if torch.compiler.is_compiling():
        return (x[..., None] * w).sum(-2)
    return torch.einsum("tki,tkio->tko", x, w)


def _routed(d: Dims, w: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
            expert_base: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts: picked when the tokens' top-k choices are fewer than the experts, else
    dense. The row count is known when run eagerly; in a traced program it is symbolic, so
    both ways are traced and `torch.cond` picks at run time (one artifact serves a decode
    step of one sequence and one of sixty-four).

    Expert parallel (`expert_base` given): `w` holds only this rank's experts, global ids
    expert_base.. expert_base+n-1; choices of other ranks' experts weigh 0 here, so the result
    is this rank's share of the sum, which the ranks add up (all-reduce)."""
    experts = _expert_tensors(w)
    n = next(iter(experts.values())).shape[0]
    if expert_base is not None:
        local = idx - expert_base
        weights = torch.where((local >= 0) & (local < n), weights, torch.zeros_like(weights))
        idx = local.clamp(0, n - 1)
    few = h.shape[0] * d.topk < n
    if isinstance(few, bool):
        return (_experts_picked if few else _experts_dense)(d, experts, h, idx, weights)
    names = sorted(experts)

    def branch(fn):
        return lambda h, idx, weights, *tensors: fn(d, dict(zip(names, tensors, strict=True)), h, idx, weights)

    return torch.cond(few, branch(_experts_picked), branch(_experts_dense), (h, idx, weights, *(experts[n] for n in names)))


def moe(d: Dims, w: dict[str, torch.Tensor], hash_routed: bool, h: torch.Tensor, tokens: torch.Tensor,
        expert_base: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(routed experts' output — this rank's share when expert parallel —, shared expert's)."""
    scores = torch.sqrt(F.softplus(linear(w, "ffn.gate", h)))  # sqrtsoftplus, [T, E]
    if hash_routed:
        idx = w["ffn.gate.tid2eid"][tokens].long()
    else:
        idx = torch.topk(scores + w["ffn.gate.bias"].float(), d.topk, dim=-1).indices
    weights = torch.gather(scores, 1, idx)
    if d.norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    weights = weights * d.routed_scale
    shared = linear(w, "ffn.shared_experts.w2",
                    _swiglu(d, linear(w, "ffn.shared_experts.w1", h), linear(w, "ffn.shared_experts.w3", h)))
    return _routed(d, w, h, idx, weights, expert_base), shared


# ---- blocks and programs -------------------------------------------------------------------

def block(d: Dims, kind: str, ratio: int, hash_routed: bool, w: dict[str, torch.Tensor],
          x: torch.Tensor, tokens: torch.Tensor, rows: Rows, cache: dict[str, torch.Tensor],
          prefill: bool, expert_base: torch.Tensor | None = None):
    """One transformer block on the hc residual stream X [T, hc, D]; returns (the new X, the
    new cache rows). Expert parallel (`expert_base`: this rank's first expert), the block stops
    short of its last step: it returns the FFN_PARTS instead of X, because the routed experts'
    output is summed over ranks first (`ffn_out` finishes the block)."""
    inp, post, comb = hc_pre(d, w, "attn", x)
    y, new_rows = attention(d, w, kind, ratio, rms_norm(inp, w["attn_norm.weight"]), rows, cache, prefill)
    x = hc_post(x, y, post, comb)
    inp, post, comb = hc_pre(d, w, "ffn", x)
    routed, shared = moe(d, w, hash_routed, rms_norm(inp, w["ffn_norm.weight"]), tokens, expert_base)
    if expert_base is not None:
        return (x, post, comb, routed, shared), new_rows
    return hc_post(x, routed + shared, post, comb), new_rows


FFN_PARTS = 5  # (x, post, comb, routed share, shared expert): what an expert-parallel block returns


def ffn_out(parts: tuple[torch.Tensor, ...], routed: torch.Tensor) -> torch.Tensor:
    """An expert-parallel block's output, once `routed` is summed over every rank."""
    x, post, comb, _, shared = parts
    return hc_post(x, routed + shared, post, comb)


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
