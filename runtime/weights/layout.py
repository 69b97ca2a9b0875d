"""The packed layout as data, without torch: `RULES`, and the `PackedLayout` of every packed name,
dtype and shape a config implies. The launch plan, the program keys and the sidecar contract
are computed from it in processes that never import torch; `runtime.weights.pack` applies it.

Quantised weights keep the checkpoint's codes (QUANT), in the matmul layout: `<family>.qweight`
holds FP8 weights as stored (F8_E4M3, [.., in, out]) and FP4 weights packed, two e2m1 codes a
byte (U8, [.., in/2, out]: the checkpoint's bytes transposed whole, so byte j of column o holds
inputs 2j and 2j+1; their bits placed for serving: magnitudes in bits 0-2 and 3-5, signs in 6 and 7,
`runtime.weights.pack.serving_fp4`); `<family>.qscale` [.., in/block_in, out/block_out]
the checkpoint's E8M0 block scales as bytes (U8). Nothing is widened, so the packed layout is
the checkpoint's size (`family_bytes` says so per family). The programs dequantise where they
multiply: W = value(q) · 2^(qscale - 127) per block. [.., in/2, out] rather than the
checkpoint's [out, in/2]: a compiled kernel then decodes a row of bytes into a row of outputs
with vector instructions (on [out, in/2] every byte serves two neighbouring lanes of the
reduction, and inductor's CPU kernels fell back to scalar code: 15× slower).
"""


from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase

from runtime.model.config import ConfigError, DeepSeekV4Config
from runtime.model.tensors import BF16, F32, FP4, FP8, I64, Param, params_by_group, stored_tensors
from store.checkpoint import DTYPE_SIZES

# 4: FP4 bytes with their bits placed for serving (3 kept the checkpoint's nibbles; 2 widened each
# code to an int8)
PACKER_VERSION = "4"
PACK_FORMAT = "dsv4-packed"
PACK_LAYOUT = {"quant": "fp8 as stored, fp4 e2m1 pairs (magnitudes bits 0-2 even, 3-5 odd; signs 6 even, 7 odd;"
                        " in/2,out); e8m0 block scales",
               "matmul": "in,out", "experts": "rank-major",
               "groups": ["all", "csa", "hca", "hash", "bias"]}

QUANT, T, KEEP, I32 = "quant", "transpose", "keep", "int32"
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
    Rule("attn.wq_a.weight", QUANT, ALL),
    Rule("attn.q_norm.weight", KEEP, ALL),
    Rule("attn.wq_b.weight", QUANT, ALL),
    Rule("attn.wkv.weight", QUANT, ALL),
    Rule("attn.kv_norm.weight", KEEP, ALL),
    Rule("attn.wo_a.weight", QUANT, ALL),
    Rule("attn.wo_b.weight", QUANT, ALL),
    Rule("attn.attn_sink", KEEP, ALL),
    # compressed layers: stacked per kind (CSA and HCA shapes differ)
    Rule("attn.compressor.wkv.weight", T, KIND),
    Rule("attn.compressor.wgate.weight", T, KIND),
    Rule("attn.compressor.ape", KEEP, KIND),
    Rule("attn.compressor.norm.weight", KEEP, KIND),
    Rule("attn.indexer.wq_b.weight", QUANT, KIND),
    Rule("attn.indexer.weights_proj.weight", T, KIND),
    Rule("attn.indexer.compressor.wkv.weight", T, KIND),
    Rule("attn.indexer.compressor.wgate.weight", T, KIND),
    Rule("attn.indexer.compressor.ape", KEEP, KIND),
    Rule("attn.indexer.compressor.norm.weight", KEEP, KIND),
    # MoE
    Rule("ffn.gate.weight", T, ALL),
    Rule("ffn.gate.tid2eid", I32, HASH),
    Rule("ffn.gate.bias", KEEP, BIAS),
    Rule("ffn.shared_experts.w1.weight", QUANT, ALL),
    Rule("ffn.shared_experts.w2.weight", QUANT, ALL),
    Rule("ffn.shared_experts.w3.weight", QUANT, ALL),
    Rule("ffn.experts.*.w1.weight", QUANT, EXPERTS),
    Rule("ffn.experts.*.w2.weight", QUANT, EXPERTS),
    Rule("ffn.experts.*.w3.weight", QUANT, EXPERTS),
    # MTP only
    Rule("enorm.weight", KEEP, ALL),
    Rule("hnorm.weight", KEEP, ALL),
    Rule("e_proj.weight", QUANT, ALL),
    Rule("h_proj.weight", QUANT, ALL),
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
    part: str  # "" for plain tensors; "qweight" / "qscale" for a quantised weight's pair


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint parameter lands: packed tensor name(s) and the leading index."""

    names: tuple[str, ...]  # (qweight, qscale) for QUANT, else one name
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


def quant_blocks(config: DeepSeekV4Config, p: Param) -> tuple[int, int]:
    """(inputs, outputs) sharing one E8M0 scale of a quantised parameter: FP8 blocks, FP4 groups."""
    if p.fmt == FP8:
        b_out, b_in = config.fp8_block
        return b_in, b_out
    if p.fmt == FP4:
        return config.fp4_group, 1
    raise ValueError(f"{p.name}: {p.fmt} is not a block-quantised format")


def _packed_shapes(config: DeepSeekV4Config, rule: Rule, p: Param,
                   lead: tuple[int, ...]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(part, dtype, shape) of what one parameter contributes, with `lead` stacking dims."""
    if rule.transform == QUANT:
        out, inp = p.shape
        b_in, b_out = quant_blocks(config, p)
        if inp % b_in or out % b_out:
            raise ConfigError(f"{config.source}: {p.name} [{out}, {inp}] is not whole blocks of "
                              f"{b_out}x{b_in}; the packed layout keeps one scale per block")
        weight = ("F8_E4M3", (*lead, inp, out)) if p.fmt == FP8 else ("U8", (*lead, inp // 2, out))
        return [("qweight", *weight), ("qscale", "U8", (*lead, inp // b_in, out // b_out))]
    if rule.transform == T:
        out, inp = p.shape
        return [("", _ST_DTYPE[p.fmt], (*lead, inp, out))]
    if rule.transform == I32:
        return [("", "I32", (*lead, *p.shape))]
    return [("", _ST_DTYPE[p.fmt], (*lead, *p.shape))]


class PackedLayout:
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
        # (scope, layer, family) → what every expert of that family shares: V4-Flash has 33k
        # expert tensors of 129 families, and the launch plan builds this table in every process
        shared: dict[tuple[str, int, str], tuple[Rule, str, tuple[str, ...], int]] = {}
        for _, plist in self.groups:
            for p in plist:
                scope, rel, layer = _relative(p.name)
                expert = _EXPERT.search(rel) if scope else None
                family = rel if expert is None else f"{rel[:expert.start()]}.experts.*.{rel[expert.end():]}"
                known = shared.get((scope, layer, family))
                if known is None:
                    rule = rule_for(family)
                    if not scope:
                        self._add(rule, p, p.name.removesuffix(".weight") if rule.transform == QUANT else p.name, ())
                        continue
                    prefix = self._group_name(scope, rule, layer)
                    fam = _base(rule.family) if rule.transform == QUANT else rule.family.replace(".*", "")
                    layers = members.setdefault((prefix, fam), [])
                    if layer not in layers:
                        layers.append(layer)
                    params.setdefault((prefix, fam), p)
                    known = shared[(scope, layer, family)] = (
                        rule, prefix, self._names(rule, f"{prefix}.{fam}"), layers.index(layer))
                rule, prefix, names, slot_layer = known
                if expert is not None:
                    e = int(expert.group(1))
                    index = (e // experts_per_rank, slot_layer, e % experts_per_rank)
                else:
                    index = (slot_layer,)
                self.slots[p.name] = Slot(names, index, rule, prefix)
        for (prefix, fam), layers in members.items():
            p = params[(prefix, fam)]
            rule = self.slots[p.name].rule
            lead = (self.ranks, len(layers), experts_per_rank) if rule.group == EXPERTS else (len(layers),)
            self._add(rule, p, f"{prefix}.{fam}", lead, register_slot=False)

    def _names(self, rule: Rule, base: str) -> tuple[str, ...]:
        return (f"{base}.qweight", f"{base}.qscale") if rule.transform == QUANT else (base,)

    def _add(self, rule: Rule, p: Param, base: str, lead: tuple[int, ...], register_slot: bool = True) -> None:
        for part, dtype, shape in _packed_shapes(self.config, rule, p, lead):
            name = f"{base}.{part}" if part else base
            self.tensors[name] = PackedTensor(name, dtype, shape, rule, part)
        if register_slot:
            self.slots[p.name] = Slot(self._names(rule, base), (), rule)

    def names(self) -> set[str]:
        return set(self.tensors)

    def total_bytes(self) -> int:
        """The packed tensors' bytes (what a sidecar holds besides its header)."""
        return sum(_nbytes(t.dtype, t.shape) for t in self.tensors.values())

    def checkpoint_bytes(self) -> int:
        """The checkpoint's tensor bytes for this config (weights and their scales)."""
        return sum(ckpt for ckpt, _ in self.family_bytes().values())

    def family_bytes(self) -> dict[str, tuple[int, int]]:
        """Per tensor family (a RULES row): (checkpoint bytes, packed bytes). Every packed
        family keeps its checkpoint's bytes, except tid2eid, narrowed from int64 to int32."""
        out: dict[str, list[int]] = {}
        for _, plist in self.groups:
            for p in plist:
                family = self.slots[p.name].rule.family
                out.setdefault(family, [0, 0])[0] += sum(t.nbytes for t in stored_tensors(self.config, p))
        for t in self.tensors.values():
            out.setdefault(t.rule.family, [0, 0])[1] += _nbytes(t.dtype, t.shape)
        return {family: (ckpt, packed) for family, (ckpt, packed) in out.items()}


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_SIZES[dtype]
