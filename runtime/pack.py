"""Packing: checkpoint tensors → the serving layout the programs consume (and sidecars hold).

`RULES` is the one table of packing: one row per tensor family, naming the transform and the
group the family is stacked in. It is also the sidecar's tensor-name contract: `plan()` derives
every packed name, dtype and shape from it and the config, before any weight is read.

Layout (PACK_LAYOUT, recorded in the sidecar key):
- FP8 / FP4 weights are dequantised with their E8M0 scales and requantised to int8 with one
  fp32 scale per output row (W8A8-style): `<family>.qweight` [.., in, out] (matmul layout:
  x @ W) and `<family>.qscale` [.., out].
- bf16/fp32 matrices used as matmuls are transposed to [in, out]; norms and vectors are kept.
- Per-layer tensors are stacked on a leading axis per group: `layers.*` (all main layers),
  `layers.csa.*` / `layers.hca.*` (compressed layers of that kind), `layers.hash.*` (tid2eid,
  as int32) and `layers.bias.*` (score-routed layers). MTP layers use the `mtp.` prefix.
- Routed experts are stacked rank-major, `[ranks, layers, experts/ranks, …]`, so the weights
  one rank serves are one contiguous byte range (one mapping per rank), not `layers` strided
  pieces. This departs from a leading layer axis on purpose.

Packing streams one layer at a time (`stream()`): peak memory is one layer's tensors, whatever
the depth. The same stream feeds the sidecar writer and the in-memory packer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

from runtime.config import DeepSeekV4Config
from runtime.tensors import BF16, F32, FP4, FP8, I64, Param, params_by_group
from store.checkpoint import Checkpoint
from store.quant import dequant_fp4, dequant_fp8_block

PACKER_VERSION = "1"
PACK_FORMAT = "dsv4-packed"
PACK_LAYOUT = {"int8": "per-output-row", "matmul": "in,out", "experts": "rank-major",
               "groups": ["all", "csa", "hca", "hash", "bias"]}

Q8, T, KEEP, I32 = "q8", "transpose", "keep", "int32"
ALL, KIND, HASH, BIAS, EXPERTS = "all", "kind", "hash", "bias", "experts"


@dataclass(frozen=True)
class Rule:
    family: str  # relative to the layer prefix ("layers.N." / "mtp.N."), or a top-level name
    transform: str
    group: str


RULES: tuple[Rule, ...] = (
    # top level (group "all" is meaningless there: not stacked)
    Rule("embed.weight", KEEP, ALL),
    Rule("head.weight", T, ALL),
    Rule("norm.weight", KEEP, ALL),
    Rule("hc_head_fn", T, ALL),
    Rule("hc_head_base", KEEP, ALL),
    Rule("hc_head_scale", KEEP, ALL),
    # every block
    Rule("attn_norm.weight", KEEP, ALL),
    Rule("ffn_norm.weight", KEEP, ALL),
    Rule("hc_attn_fn", T, ALL),
    Rule("hc_attn_base", KEEP, ALL),
    Rule("hc_attn_scale", KEEP, ALL),
    Rule("hc_ffn_fn", T, ALL),
    Rule("hc_ffn_base", KEEP, ALL),
    Rule("hc_ffn_scale", KEEP, ALL),
    Rule("attn.wq_a.weight", Q8, ALL),
    Rule("attn.q_norm.weight", KEEP, ALL),
    Rule("attn.wq_b.weight", Q8, ALL),
    Rule("attn.wkv.weight", Q8, ALL),
    Rule("attn.kv_norm.weight", KEEP, ALL),
    Rule("attn.wo_a.weight", Q8, ALL),
    Rule("attn.wo_b.weight", Q8, ALL),
    Rule("attn.attn_sink", KEEP, ALL),
    # compressed layers: stacked per kind (CSA and HCA shapes differ)
    Rule("attn.compressor.wkv.weight", T, KIND),
    Rule("attn.compressor.wgate.weight", T, KIND),
    Rule("attn.compressor.ape", KEEP, KIND),
    Rule("attn.compressor.norm.weight", KEEP, KIND),
    Rule("attn.indexer.wq_b.weight", Q8, KIND),
    Rule("attn.indexer.weights_proj.weight", T, KIND),
    Rule("attn.indexer.compressor.wkv.weight", T, KIND),
    Rule("attn.indexer.compressor.wgate.weight", T, KIND),
    Rule("attn.indexer.compressor.ape", KEEP, KIND),
    Rule("attn.indexer.compressor.norm.weight", KEEP, KIND),
    # MoE
    Rule("ffn.gate.weight", T, ALL),
    Rule("ffn.gate.tid2eid", I32, HASH),
    Rule("ffn.gate.bias", KEEP, BIAS),
    Rule("ffn.shared_experts.w1.weight", Q8, ALL),
    Rule("ffn.shared_experts.w2.weight", Q8, ALL),
    Rule("ffn.shared_experts.w3.weight", Q8, ALL),
    Rule("ffn.experts.*.w1.weight", Q8, EXPERTS),
    Rule("ffn.experts.*.w2.weight", Q8, EXPERTS),
    Rule("ffn.experts.*.w3.weight", Q8, EXPERTS),
    # MTP only
    Rule("enorm.weight", KEEP, ALL),
    Rule("hnorm.weight", KEEP, ALL),
    Rule("e_proj.weight", Q8, ALL),
    Rule("h_proj.weight", Q8, ALL),
)

_ST_DTYPE = {BF16: "BF16", F32: "F32", I64: "I64"}
_LAYER_PREFIX = re.compile(r"^(layers|mtp)\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@functools.lru_cache(maxsize=4096)
def rule_for(relative_name: str) -> Rule:
    for r in RULES:
        if fnmatchcase(relative_name, r.family):
            return r
    raise KeyError(f"no packing rule for tensor family '{relative_name}'")


def _base(family: str) -> str:
    return family.removesuffix(".weight").replace(".*", "")


@dataclass(frozen=True)
class PackedTensor:
    """One tensor of the packed layout: where its slices come from and its final shape."""

    name: str
    dtype: str  # safetensors dtype
    shape: tuple[int, ...]
    rule: Rule
    part: str  # "" for plain tensors; "qweight" / "qscale" for int8 pairs


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint parameter lands: packed tensor name(s) and the leading index."""

    names: tuple[str, ...]  # (qweight, qscale) for Q8, else one name
    index: tuple[int, ...]
    rule: Rule
    prefix: str = ""  # the group ("layers", "layers.csa", "mtp.bias", …); "" at top level

    def relative(self, name: str) -> str:
        """A packed name without its group: the key the model's block functions use."""
        return name[len(self.prefix) + 1:] if self.prefix else name


def _relative(name: str) -> tuple[str, str, int]:
    """'layers.3.attn.wq_a.weight' → ('layers', 'attn.wq_a.weight', 3); top-level → ('', name, -1)."""
    m = _LAYER_PREFIX.match(name)
    if not m:
        return "", name, -1
    return m.group(1), name[m.end():], int(m.group(2))


def _packed_shapes(rule: Rule, p: Param, lead: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(part, dtype, shape) of what one parameter contributes, with `lead` stacking dims."""
    if rule.transform == Q8:
        out, inp = p.shape
        return [("qweight", "I8", (*lead, inp, out)), ("qscale", "F32", (*lead, out))]
    if rule.transform == T:
        out, inp = p.shape
        return [("", _ST_DTYPE[p.fmt], (*lead, inp, out))]
    if rule.transform == I32:
        return [("", "I32", (*lead, *p.shape))]
    return [("", _ST_DTYPE[p.fmt], (*lead, *p.shape))]


class PackPlan:
    """Every packed tensor and, for every checkpoint parameter, the slot it fills."""

    def __init__(self, config: DeepSeekV4Config, ranks: int = 1):
        config.check_ranks(ranks)
        self.config, self.ranks = config, ranks
        self.tensors: dict[str, PackedTensor] = {}
        self.slots: dict[str, Slot] = {}
        self.groups: list[tuple[str, list[Param]]] = list(params_by_group(config))
        self._build()

    def _group_name(self, scope: str, rule: Rule, layer: int) -> str:
        c = self.config
        global_layer = layer if scope == "layers" else c.num_hidden_layers + layer
        if rule.group == KIND:
            return f"{scope}.{c.layer_kind(global_layer)}"
        if rule.group in (HASH, BIAS):
            return f"{scope}.{rule.group}"
        return scope

    def _build(self) -> None:
        c = self.config
        members: dict[tuple[str, str], list[int]] = {}  # (group prefix, family) → layers
        params: dict[tuple[str, str], Param] = {}
        experts_per_rank = c.n_routed_experts // self.ranks
        for _, plist in self.groups:
            for p in plist:
                scope, rel, layer = _relative(p.name)
                rule = rule_for(_EXPERT.sub(".experts.*.", rel) if scope else rel)
                if not scope:
                    self._add(rule, p, p.name.removesuffix(".weight") if rule.transform == Q8 else p.name, ())
                    continue
                prefix = self._group_name(scope, rule, layer)
                fam = _base(rule.family) if rule.transform == Q8 else rule.family.replace(".*", "")
                key = (prefix, fam)
                layers = members.setdefault(key, [])
                if layer not in layers:
                    layers.append(layer)
                params.setdefault(key, p)
                slot_layer = layers.index(layer)
                if rule.group == EXPERTS:
                    e = int(_EXPERT.search(rel).group(1))
                    index = (e // experts_per_rank, slot_layer, e % experts_per_rank)
                else:
                    index = (slot_layer,)
                self.slots[p.name] = Slot(self._names(rule, f"{prefix}.{fam}"), index, rule, prefix)
        for (prefix, fam), layers in members.items():
            p = params[(prefix, fam)]
            rule = self.slots[p.name].rule
            if rule.group == EXPERTS:
                lead = (self.ranks, len(layers), experts_per_rank)
            else:
                lead = (len(layers),)
            self._add(rule, p, f"{prefix}.{fam}", lead, register_slot=False)

    def _names(self, rule: Rule, base: str) -> tuple[str, ...]:
        return (f"{base}.qweight", f"{base}.qscale") if rule.transform == Q8 else (base,)

    def _add(self, rule: Rule, p: Param, base: str, lead: tuple[int, ...], register_slot: bool = True) -> None:
        for part, dtype, shape in _packed_shapes(rule, p, lead):
            name = f"{base}.{part}" if part else base
            self.tensors[name] = PackedTensor(name, dtype, shape, rule, part)
        if register_slot:
            self.slots[p.name] = Slot(self._names(rule, base), (), rule)

    def names(self) -> set[str]:
        return set(self.tensors)

    def total_bytes(self) -> int:
        from store.checkpoint import DTYPE_SIZES

        total = 0
        for t in self.tensors.values():
            n = DTYPE_SIZES[t.dtype]
            for d in t.shape:
                n *= d
            total += n
        return total


# ---- transforms ----------------------------------------------------------------------------

def dequantize(ckpt: Checkpoint, config: DeepSeekV4Config, p: Param) -> torch.Tensor:
    """A parameter as float32, whatever its stored format (the reference path uses this too)."""
    w = ckpt.read(p.name)
    if p.fmt == FP8:
        return dequant_fp8_block(w, ckpt.read(p.scale_name), config.fp8_block)
    if p.fmt == FP4:
        return dequant_fp4(w, ckpt.read(p.scale_name), config.fp4_group)
    return w.float()


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] → (int8 [in, out], fp32 scale [out]) with w ≈ (q * scale).T."""
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.t().contiguous(), scale.to(torch.float32)


def pack_param(ckpt: Checkpoint, config: DeepSeekV4Config, p: Param, rule: Rule) -> tuple[torch.Tensor, ...]:
    if rule.transform == Q8:
        return quantize_rows(dequantize(ckpt, config, p))
    w = ckpt.read(p.name)
    if rule.transform == T:
        return (w.t().contiguous(),)
    if rule.transform == I32:
        return (w.to(torch.int32),)
    return (w.contiguous(),)


Part = tuple[str, tuple[int, ...], torch.Tensor]  # (packed name, leading index, slice)
LayerProgress = Callable[[int, int, str], None]  # (groups done, groups total, group name)


def stream(ckpt: Checkpoint, plan: PackPlan, progress: LayerProgress | None = None) -> Iterator[Part]:
    """Packed slices, one checkpoint group (top, layer, MTP layer) at a time."""
    total = len(plan.groups)
    for i, (group, plist) in enumerate(plan.groups):
        for p in plist:
            slot = plan.slots[p.name]
            for name, tensor in zip(slot.names, pack_param(ckpt, plan.config, p, slot.rule), strict=True):
                yield name, slot.index, tensor
        if progress:
            progress(i + 1, total, group)


_TORCH = {"I8": torch.int8, "F32": torch.float32, "BF16": torch.bfloat16, "I32": torch.int32,
          "I64": torch.int64}


def pack_in_memory(ckpt: Checkpoint, plan: PackPlan, progress: LayerProgress | None = None) -> dict[str, torch.Tensor]:
    """The no-sidecar path: the whole packed layout as host tensors."""
    out = {t.name: torch.empty(t.shape, dtype=_TORCH[t.dtype]) for t in plan.tensors.values()}
    for name, index, part in stream(ckpt, plan, progress):
        out[name][index] = part
    return out

