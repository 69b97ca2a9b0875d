"""The DeepSeek V4 tensor contract: every checkpoint tensor, derived from the config alone.

One logical parameter (`Param`) per weight; FP8 and FP4 parameters expand to a `.weight` and
an E8M0 `.scale` tensor. The synthetic generator writes exactly this list, `dsv4 check`
compares a checkpoint against it, and the packer reads through it. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from runtime.model.config import CSA, HCA, DeepSeekV4Config
from store.checkpoint import TensorSpec

FP8, FP4, BF16, F32, I64 = "fp8", "fp4", "bf16", "f32", "i64"
_PLAIN_DTYPES = {BF16: "BF16", F32: "F32", I64: "I64"}


@dataclass(frozen=True)
class Param:
    """One logical weight: its stored format, its float (logical) shape, how to synthesise it."""

    name: str
    fmt: str
    shape: tuple[int, ...]
    init: str  # linear | norm | small | gate_bias | tid2eid | scale_one

    @property
    def scale_name(self) -> str:
        return self.name.removesuffix(".weight") + ".scale"


def _linear(name: str, out: int, inp: int, fmt: str) -> Param:
    return Param(f"{name}.weight", fmt, (out, inp), "linear")


def _norm(name: str, dim: int) -> Param:
    return Param(f"{name}.weight", BF16, (dim,), "norm")


def _hc(prefix: str, c: DeepSeekV4Config, which: str) -> list[Param]:
    hc, mix = c.hc_mult, c.hc_mix_dim
    return [
        Param(f"{prefix}hc_{which}_fn", F32, (mix, hc * c.hidden_size), "small"),
        Param(f"{prefix}hc_{which}_base", F32, (mix,), "small"),
        Param(f"{prefix}hc_{which}_scale", F32, (3,), "scale_one"),
    ]


def _compressor(prefix: str, c: DeepSeekV4Config, dim: int, ratio: int, overlap: bool) -> list[Param]:
    width = 2 * dim if overlap else dim
    return [
        _linear(f"{prefix}.wkv", width, c.hidden_size, BF16),
        _linear(f"{prefix}.wgate", width, c.hidden_size, BF16),
        Param(f"{prefix}.ape", F32, (ratio, width), "small"),
        _norm(f"{prefix}.norm", dim),
    ]


def layer_params(c: DeepSeekV4Config, prefix: str, layer: int, hash_routed: bool) -> list[Param]:
    """Every parameter of one transformer block (main layer or MTP layer)."""
    h, heads, hd = c.hidden_size, c.num_attention_heads, c.head_dim
    kind, ratio = c.layer_kind(layer), c.compress_ratios[layer]
    p = prefix
    out: list[Param] = [_norm(f"{p}attn_norm", h), _norm(f"{p}ffn_norm", h)]
    out += _hc(p, c, "attn") + _hc(p, c, "ffn")
    out += [
        _linear(f"{p}attn.wq_a", c.q_lora_rank, h, FP8),
        _norm(f"{p}attn.q_norm", c.q_lora_rank),
        _linear(f"{p}attn.wq_b", heads * hd, c.q_lora_rank, FP8),
        _linear(f"{p}attn.wkv", hd, h, FP8),
        _norm(f"{p}attn.kv_norm", hd),
        _linear(f"{p}attn.wo_a", c.o_groups * c.o_lora_rank, heads * hd // c.o_groups, FP8),
        _linear(f"{p}attn.wo_b", h, c.o_groups * c.o_lora_rank, FP8),
        Param(f"{p}attn.attn_sink", F32, (heads,), "small"),
    ]
    if kind == HCA:
        out += _compressor(f"{p}attn.compressor", c, hd, ratio, overlap=False)
    elif kind == CSA:
        out += _compressor(f"{p}attn.compressor", c, hd, ratio, overlap=True)
        out += [
            _linear(f"{p}attn.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank, FP8),
            _linear(f"{p}attn.indexer.weights_proj", c.index_n_heads, h, BF16),
        ]
        out += _compressor(f"{p}attn.indexer.compressor", c, c.index_head_dim, ratio, overlap=True)
    out.append(_linear(f"{p}ffn.gate", c.n_routed_experts, h, BF16))
    if hash_routed:
        out.append(Param(f"{p}ffn.gate.tid2eid", I64, (c.vocab_size, c.num_experts_per_tok), "tid2eid"))
    else:
        out.append(Param(f"{p}ffn.gate.bias", F32, (c.n_routed_experts,), "gate_bias"))
    inter = c.moe_intermediate_size
    out += [
        _linear(f"{p}ffn.shared_experts.w1", inter * c.n_shared_experts, h, FP8),
        _linear(f"{p}ffn.shared_experts.w2", h, inter * c.n_shared_experts, FP8),
        _linear(f"{p}ffn.shared_experts.w3", inter * c.n_shared_experts, h, FP8),
    ]
    efmt = FP4 if c.expert_dtype == "fp4" else FP8
    for e in range(c.n_routed_experts):
        out += [
            _linear(f"{p}ffn.experts.{e}.w1", inter, h, efmt),
            _linear(f"{p}ffn.experts.{e}.w2", h, inter, efmt),
            _linear(f"{p}ffn.experts.{e}.w3", inter, h, efmt),
        ]
    return out


def mtp_params(c: DeepSeekV4Config, k: int) -> list[Param]:
    p, h = f"mtp.{k}.", c.hidden_size
    out = layer_params(c, p, c.num_hidden_layers + k, hash_routed=False)
    out += [
        _norm(f"{p}enorm", h),
        _norm(f"{p}hnorm", h),
        _linear(f"{p}e_proj", h, h, FP8),
        _linear(f"{p}h_proj", h, h, FP8),
        _norm(f"{p}norm", h),
    ]
    out += _head_hc(p, c)
    return out


def _head_hc(p: str, c: DeepSeekV4Config) -> list[Param]:
    hc = c.hc_mult
    return [
        Param(f"{p}hc_head_fn", F32, (hc, hc * c.hidden_size), "small"),
        Param(f"{p}hc_head_base", F32, (hc,), "small"),
        Param(f"{p}hc_head_scale", F32, (1,), "scale_one"),
    ]


def params_by_group(c: DeepSeekV4Config) -> Iterator[tuple[str, list[Param]]]:
    """Parameters in canonical order, grouped: 'top', 'layers.0', …, 'mtp.0'."""
    top = [
        Param("embed.weight", BF16, (c.vocab_size, c.hidden_size), "linear"),
        Param("head.weight", BF16, (c.vocab_size, c.hidden_size), "linear"),
        _norm("norm", c.hidden_size),
        *_head_hc("", c),
    ]
    yield "top", top
    for i in range(c.num_hidden_layers):
        yield f"layers.{i}", layer_params(c, f"layers.{i}.", i, hash_routed=c.is_hash_layer(i))
    for k in range(c.num_nextn_predict_layers):
        yield f"mtp.{k}", mtp_params(c, k)


def all_params(c: DeepSeekV4Config) -> list[Param]:
    return [p for _, group in params_by_group(c) for p in group]


def stored_tensors(c: DeepSeekV4Config, p: Param) -> list[TensorSpec]:
    """The tensor(s) a parameter is stored as in the checkpoint."""
    if p.fmt == FP8:
        b0, b1 = c.fp8_block
        out, inp = p.shape
        return [TensorSpec(p.name, "F8_E4M3", p.shape),
                TensorSpec(p.scale_name, "F8_E8M0", (-(-out // b0), -(-inp // b1)))]
    if p.fmt == FP4:
        out, inp = p.shape
        return [TensorSpec(p.name, "I8", (out, inp // 2)),
                TensorSpec(p.scale_name, "F8_E8M0", (out, inp // c.fp4_group))]
    return [TensorSpec(p.name, _PLAIN_DTYPES[p.fmt], p.shape)]


def expected_tensors(c: DeepSeekV4Config) -> list[TensorSpec]:
    """The checkpoint contract: every stored tensor with dtype and shape, canonical order."""
    return [t for p in all_params(c) for t in stored_tensors(c, p)]
