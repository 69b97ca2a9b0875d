"""The model's programs: one per (layer variant × mode), plus embed, head and the MTP ends.

A layer variant is (kind, compress ratio, routing): layers that share it share one program,
because weights are inputs. Specs are built from the config and the packed plan alone (meta
tensors give the weight shapes), so programs compile before any weight is read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime import model
from runtime.config import SLIDING, DeepSeekV4Config
from runtime.model import Dims
from runtime.pack import PackPlan
from runtime.programs import DynamicDim, ProgramSpec, TensorSpec
from runtime.weights import ModelWeights, packed_views

PREFILL, DECODE = "prefill", "decode"
MODES = (PREFILL, DECODE)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int8: "int8",
                torch.int32: "int32", torch.int64: "int64"}


@dataclass(frozen=True)
class LayerVariant:
    kind: str
    ratio: int
    hash_routed: bool

    @property
    def name(self) -> str:
        kind = self.kind if self.kind == SLIDING else f"{self.kind}{self.ratio}"
        return f"layer.{kind}.{'hash' if self.hash_routed else 'score'}"


def layer_variants(config: DeepSeekV4Config) -> dict[str, LayerVariant]:
    """Weight group ('layers.3', 'mtp.0') → its variant."""
    out = {}
    for i in range(config.num_layers_total):
        main = i < config.num_hidden_layers
        group = f"layers.{i}" if main else f"mtp.{i - config.num_hidden_layers}"
        out[group] = LayerVariant(config.layer_kind(i), config.compress_ratios[i],
                                  main and config.is_hash_layer(i))
    return out


def meta_weights(plan: PackPlan) -> ModelWeights:
    """The packed views' shapes and dtypes, with no data: what a program's signature needs."""
    from runtime.pack import _TORCH

    meta = {t.name: torch.empty(t.shape, dtype=_TORCH[t.dtype], device="meta") for t in plan.tensors.values()}
    return packed_views(plan, meta)


def _specs_of(prefix: str, w: dict[str, torch.Tensor]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(f"{prefix}{n}", _DTYPE_NAMES[t.dtype], tuple(t.shape)) for n, t in sorted(w.items()))


# Each factory closes over the static facts (dims, names); those are in the key via model_dims
# and the signature, and the closure's source is hashed with the functions it calls.

def _layer_fn(d: Dims, v: LayerVariant, cache_names: tuple[str, ...], weight_names: tuple[str, ...]) -> Callable:
    nc = len(cache_names)

    def layer_program(x, tokens, positions, *rest):
        cache = dict(zip(cache_names, rest[:nc], strict=True))
        w = dict(zip(weight_names, rest[nc:], strict=True))
        x, rows = model.block(d, v.kind, v.ratio, v.hash_routed, w, x, tokens, positions, cache)
        return (x, *(rows[n] for n in cache_names))

    return layer_program


def _embed_fn(d: Dims) -> Callable:
    def embed_program(tokens, embed_weight):
        return model.embed(d, {"embed.weight": embed_weight}, tokens)

    return embed_program


def _head_fn(d: Dims, weight_names: tuple[str, ...]) -> Callable:
    def head_program(x, *weights):
        return model.head(d, dict(zip(weight_names, weights, strict=True)), x)

    return head_program


def _mtp_input_fn(d: Dims, weight_names: tuple[str, ...]) -> Callable:
    def mtp_input_program(next_tokens, h, embed_weight, *weights):
        w = dict(zip(weight_names, weights, strict=True))
        return model.mtp_input(d, w, embed_weight[next_tokens], h)

    return mtp_input_program


TOP_HEAD = ("hc_head_base", "hc_head_fn", "hc_head_scale", "norm.weight", "head.weight")
MTP_INPUT = ("e_proj.qscale", "e_proj.qweight", "enorm.weight", "h_proj.qscale", "h_proj.qweight", "hnorm.weight")


@dataclass(frozen=True)
class ModelPrograms:
    """Every program spec of a deployment, and how the engine calls each group."""

    dims: Dims
    specs: dict[str, ProgramSpec]
    variants: dict[str, LayerVariant]
    cache_names: dict[str, tuple[str, ...]]  # variant name → cache row names
    weight_names: dict[str, tuple[str, ...]]  # program family → weight keys, in input order


def build_programs(config: DeepSeekV4Config, plan: PackPlan, max_seq: int) -> ModelPrograms:
    d = Dims.of(config, max_seq)
    meta = meta_weights(plan)
    variants = layer_variants(config)
    tokens_dim = DynamicDim("T", 1, max_seq)
    layout = {"ranks": plan.ranks, "max_seq": max_seq}
    model_dims = d.to_json()
    specs: dict[str, ProgramSpec] = {}
    cache_names: dict[str, tuple[str, ...]] = {}
    weight_names: dict[str, tuple[str, ...]] = {}

    def add(name: str, fn_for_mode: Callable[[], Callable], inputs_for: Callable[[int | str], tuple]) -> None:
        for mode in MODES:
            t = "T" if mode == PREFILL else 1
            specs[f"{name}.{mode}"] = ProgramSpec(
                f"{name}.{mode}", fn_for_mode(), inputs_for(t),
                dims=(tokens_dim,) if mode == PREFILL else (), layout=layout, model_dims=model_dims)

    def act(t):
        return (TensorSpec("x", "float32", (t, d.hc, d.hidden)), TensorSpec("tokens", "int64", (t,)),
                TensorSpec("positions", "int64", (t,)))

    for group, v in variants.items():
        if v.name in cache_names:
            continue
        caches = tuple(model.cache_shapes(d, v.kind).items())
        cache_names[v.name] = tuple(n for n, _ in caches)
        w = meta[group]
        weight_names[v.name] = tuple(sorted(w))
        cache_specs = tuple(TensorSpec(f"cache.{n}", "float32", s) for n, s in caches)
        add(v.name, lambda v=v, w=w: _layer_fn(d, v, cache_names[v.name], tuple(sorted(w))),
            lambda t, w=w, cache_specs=cache_specs: (*act(t), *cache_specs, *_specs_of("w.", w)))

    top = meta["top"]
    emb = top["embed.weight"]
    emb_spec = TensorSpec("embed.weight", _DTYPE_NAMES[emb.dtype], tuple(emb.shape))
    add("embed", lambda: _embed_fn(d), lambda t: (TensorSpec("tokens", "int64", (t,)), emb_spec))
    head_w = {n: top[n] for n in TOP_HEAD}
    weight_names["head"] = TOP_HEAD
    add("head", lambda: _head_fn(d, TOP_HEAD),
        lambda t: (TensorSpec("x", "float32", (t, d.hc, d.hidden)),
                   *(TensorSpec(n, _DTYPE_NAMES[head_w[n].dtype], tuple(head_w[n].shape)) for n in TOP_HEAD)))
    if config.num_nextn_predict_layers:
        mtp = meta["mtp.0"]
        weight_names["mtp.input"] = MTP_INPUT
        add("mtp.input", lambda: _mtp_input_fn(d, MTP_INPUT),
            lambda t: (TensorSpec("next_tokens", "int64", (t,)), TensorSpec("h", "float32", (t, d.hidden)),
                       emb_spec, *(TensorSpec(n, _DTYPE_NAMES[mtp[n].dtype], tuple(mtp[n].shape)) for n in MTP_INPUT)))
        # the MTP head is the model head over MTP's own hc_head/norm and the shared head.weight
    return ModelPrograms(d, specs, variants, cache_names, weight_names)


def program_keys(model_dir, device: str = "cpu", backend: str = "auto", max_seq: int = 1024,
                 ranks: int = 1) -> dict:
    """Live cache keys of every program this model needs (what `cache ls --model` judges by)."""
    from runtime.config import load_config
    from runtime.programs import default_backend, program_key

    config = load_config(model_dir)
    backend = default_backend(device) if backend == "auto" else backend
    programs = build_programs(config, PackPlan(config, ranks), max_seq)
    return {name: program_key(spec, backend, device) for name, spec in programs.specs.items()}
