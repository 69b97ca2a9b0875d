"""What a step must do, from the packed layout: the bytes a decode step reads and the FLOPs and
GEMM shapes a prefill multiplies, by program family (`dsv4 bench roofline`).

A decode step reads each weight once (the step's rows share it), the routed experts as its rows
picked them (each used expert's bytes once: FP4 codes and their scales), the output head whole, one
embedding row a row, the routing table's entries a row picks (hash layers), and the KV cache rows each
row must attend (its window's keys, the compressed entries visible at its position; a program that
reads more, masked, shows as lost efficiency, not as bytes). MTP's layer is not counted (the bench
decodes without speculation).

A prefill's FLOPs: every matmul weight (a layout rule that quantises or transposes it: FP8, FP4, the
BF16 and F32 projections) times its rows, two FLOPs a multiply-add: the routed experts' over the rows
each expert got, the head over the one row whose logits a prompt needs; attention's own products
(scores and values over the visible keys, the indexer's scores) counted apart, as they are no GEMM
of a weight.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

LAYER, EXPERTS, HEAD, EMBED, KV = "layer", "experts", "head", "embed", "kv cache"
FAMILIES = (LAYER, EXPERTS, HEAD, EMBED)  # the program families a step's time is split into
ROUTED = "ffn.experts."
ROUTING_TABLE = "ffn.gate.tid2eid"
HEAD_WEIGHTS = ("hc_head_base", "hc_head_fn", "hc_head_scale", "norm.weight", "head.weight")


@dataclass
class Cost:
    """Bytes (decode) or FLOPs (prefill) by family, and a prefill's GEMM shapes (rows, in, out)."""

    by_family: dict[str, float] = field(default_factory=dict)
    gemms: list[tuple[str, tuple[int, int, int]]] = field(default_factory=list)  # (family, (rows, in, out))
    attention_flops: float = 0.0

    def add(self, family: str, amount: float) -> None:
        self.by_family[family] = self.by_family.get(family, 0.0) + amount

    @property
    def total(self) -> float:
        return sum(self.by_family.values())


def _main_layers(weights) -> list[str]:
    return [g for g in weights.groups if g.startswith("layers.")]


def expert_bytes(w: dict) -> int:
    """One routed expert's bytes (w1, w3, w2: codes and scales) of a layer's weight dict."""
    return sum(t.nbytes // t.shape[0] for n, t in w.items() if n.startswith(ROUTED))


def _is_matmul(name: str, t) -> bool:
    """A weight some product multiplies: a quantised one's codes, or a transposed float matrix
    (`runtime.weights.layout.RULES`: QUANT and T); not norms, biases, `ape` or the routing table."""
    from runtime.weights.layout import QUANT, T, rule_for

    if name.endswith(".qscale") or t.dim() != 2 or name == ROUTING_TABLE:
        return False
    family = name.removesuffix(".qweight") + ".weight" if name.endswith(".qweight") else name
    if family.startswith(ROUTED):
        return True
    try:
        return rule_for(family).transform in (QUANT, T)
    except KeyError:
        return False


def _in_out(name: str, t) -> tuple[int, int]:
    """(inputs, outputs) of a matmul weight stored [in, out] (FP4 codes: two inputs a byte)."""
    rows, cols = t.shape[-2], t.shape[-1]
    return (2 * rows if str(t.dtype) == "torch.uint8" else rows), cols


def kv_bytes(d, kind: str, ratio: int, position: int) -> int:
    """The cache bytes one decode row at `position` must read in one layer (float32 rows): its
    window's keys, its own window's compressor inputs (CSA: two windows, both compressors), and the
    entries visible there (CSA: the indexer's keys, then the top index_topk entries)."""
    from runtime.model.config import CSA, HCA

    seen = position + 1
    floats = min(seen, d.window) * d.head_dim
    entries = seen // ratio if ratio else 0
    if kind == CSA:
        floats += 2 * ratio * 2 * (2 * d.head_dim + 2 * d.index_dim)  # kv and gate, two windows
        floats += entries * d.index_dim + min(entries, d.index_topk) * d.head_dim
    elif kind == HCA:
        floats += ratio * 2 * d.head_dim + entries * d.head_dim
    return 4 * floats


def decode_bytes(programs, weights, positions: Sequence[int], picked: Sequence[int]) -> Cost:
    """The bytes a decode step of rows at `positions` must read; `picked`: the distinct experts
    its rows picked in each main layer, in layer order (the routing's, as measured)."""
    d, cost = programs.dims, Cost()
    rows = len(positions)
    layers = _main_layers(weights)
    if len(picked) != len(layers):
        raise ValueError(f"{len(picked)} layers' picks for {len(layers)} layers")
    for group, used in zip(layers, picked, strict=True):
        w = weights[group]
        for name, t in w.items():
            if name.startswith(ROUTED):
                continue
            cost.add(LAYER, rows * d.topk * t.element_size() if name == ROUTING_TABLE else t.nbytes)
        cost.add(EXPERTS, used * expert_bytes(w))
        v = programs.variants[group]
        cost.add(KV, sum(kv_bytes(d, v.kind, v.ratio, p) for p in positions))
    top = weights["top"]
    cost.add(HEAD, sum(top[n].nbytes for n in HEAD_WEIGHTS))
    cost.add(EMBED, rows * d.hidden * top["embed.weight"].element_size())
    return cost


def prefill_flops(programs, weights, tokens: int, expert_rows: Sequence[Sequence[int]]) -> Cost:
    """The FLOPs of one prompt of `tokens` tokens through the main layers and the head (its last
    row's logits); `expert_rows`: each main layer's rows per expert (the routing's, as measured)."""
    d, cost = programs.dims, Cost()
    for group, per_expert in zip(_main_layers(weights), expert_rows, strict=True):
        w = weights[group]
        expert_mats = []
        for name, t in w.items():
            if not _is_matmul(name, t if not name.startswith(ROUTED) else t[0]):
                continue
            if name.startswith(ROUTED):
                expert_mats.append(_in_out(name, t[0]))
                continue
            i, o = _in_out(name, t)
            cost.add(LAYER, 2.0 * tokens * i * o)
            cost.gemms.append((LAYER, (tokens, i, o)))
        for count in (c for c in per_expert if c):
            for i, o in expert_mats:
                cost.add(EXPERTS, 2.0 * count * i * o)
                cost.gemms.append((EXPERTS, (count, i, o)))
        cost.attention_flops += _attention_flops(d, programs.variants[group], tokens)
    top = weights["top"]
    for name in ("hc_head_fn", "head.weight"):
        i, o = _in_out(name, top[name])
        cost.add(HEAD, 2.0 * i * o)
        cost.gemms.append((HEAD, (1, i, o)))
    return cost


def _attention_flops(d, variant, tokens: int) -> float:
    """Scores and values over the keys each row sees (window, compressed entries), the indexer's
    scores of every visible entry: two FLOPs a multiply-add."""
    from runtime.model.config import CSA, HCA

    total = 0.0
    per_key = 2 * 2 * d.heads * d.head_dim  # a score and a value, each a multiply-add per channel
    for t in range(tokens):
        keys = min(t + 1, d.window)
        entries = (t + 1) // variant.ratio if variant.ratio else 0
        if variant.kind == CSA:
            keys += min(entries, d.index_topk)
            total += 2.0 * d.index_heads * d.index_dim * entries
        elif variant.kind == HCA:
            keys += entries
        total += per_key * keys
    return total


def gemm_seconds(cost: Cost, rates: dict[tuple[int, int, int], float], family: str | None = None) -> float:
    """Seconds the prefill's GEMMs (of one family, or all) take at the measured rates of their
    shapes (FLOP/s)."""
    return sum(2.0 * math.prod(shape) / rates[shape] for f, shape in cost.gemms if family in (None, f))
