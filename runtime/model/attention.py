"""Attention: the sliding window, compressed KV entries (CSA, HCA: gated pooling, computed once
per window) and CSA's indexer top-k; the caches' rows (`Rows`). See `runtime.model.forward`."""

from __future__ import annotations

import math

import torch

from runtime.model.config import CSA, HCA, SLIDING
from runtime.model.dims import Dims
from runtime.model.ops import linear, linear_groups, rms_norm
from runtime.model.rope import rope, rope_inv_freq


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

    def at(self, cache: torch.Tensor, new: torch.Tensor, q: torch.Tensor,
           cache_index: torch.Tensor | None = None) -> torch.Tensor:
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
    inv_freq = rope_inv_freq(d, compressed=kind != SLIDING, device=h.device)
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
    o = linear_groups(w, "attn.wo_a", out.reshape(t, d.o_groups, d.heads * d.head_dim // d.o_groups))
    return linear(w, "attn.wo_b", o.reshape(t, d.o_groups * d.o_lora)), out_rows
