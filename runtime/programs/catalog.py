"""The model's programs as specs: one per (layer variant × mode), the routed experts, plus embed,
head and MTP input.

Torch-free: signatures come from the config and the packed layout's shapes, the functions are named
("runtime.model.factories:<factory>") with their captures as data, so the launch plan computes every
program's key in a process that never imports torch. A layer variant is (kind, compress ratio,
routing): layers that share it share one program, because weights are inputs.

The routed experts are a program of their own (`ROUTED_APART`): every layer program stops before
them, and `experts.picked` serves every layer, so the expert math — most of a layer's compile, the
FP4 decode with it — compiles once per model instead of once per layer program (the engine's calls
put them back together: `runtime.programs.calls`, which runs more rows than it suits eagerly, each
expert over its own rows: a shape that depends on the routing, which no static program holds;
there, on the cpu, `experts.native`: that eager function given the FP4 products compiled from C++).
`ROUTED_IN_LAYER`, each layer program with its routed experts inside, is the form before, kept as
`dsv4 bench compile`'s baseline. Where `experts.native` is built, the programs with FP8 and BF16
products (the layers, the head, the MTP input) say `native_dense`: each such product is a
`dsv4::dense` call, which runs on its library at few rows (`runtime.model.ops.dense_calls`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from runtime.model.config import SLIDING, DeepSeekV4Config
from runtime.model.dims import MAX_SLOTS, Dims, cache_shapes
from runtime.programs.spec import DynamicDim, ProgramSpec, TensorSpec
from runtime.toolchain import cxx
from runtime.weights.layout import EXPERTS, PackedLayout

PREFILL, DECODE = "prefill", "decode"
MODES = (PREFILL, DECODE)
# A prefill is one sequence's tokens (T ≤ max_seq); a decode step packs rows of many sequences,
# each in its own cache slot: up to MAX_SLOTS slots, two rows each (MTP verify).
MAX_DECODE_ROWS = 2 * MAX_SLOTS
EXPERTS_PROGRAM = "experts"  # what the engine calls: one rank's routed experts over rows (of every rank)
# the program behind it for few rows: only each row's picked experts (more rows run grouped, eagerly)
EXPERTS_PICKED = f"{EXPERTS_PROGRAM}.picked"
# and the grouped way (every expert over its own rows, eagerly) with its FP4 products compiled
# natively (`runtime.model.native`): the same inputs, built from C++ rather than traced
EXPERTS_NATIVE = f"{EXPERTS_PROGRAM}.native"
ROUTED_APART, ROUTED_IN_LAYER = "apart", "in-layer"  # the program forms (see the module's docstring)
ROUTED_PREFIX = "ffn.experts."
FNS = "runtime.model.factories"
TOP_HEAD = ("hc_head_base", "hc_head_fn", "hc_head_scale", "norm.weight", "head.weight")
MTP_INPUT = ("e_proj.qscale", "e_proj.qweight", "enorm.weight", "h_proj.qscale", "h_proj.qweight", "hnorm.weight")
# safetensors dtype → torch dtype name (what a TensorSpec holds)
_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "I8": "int8", "I32": "int32", "I64": "int64",
                "F8_E4M3": "float8_e4m3fn", "U8": "uint8"}


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


def weight_shapes(packed: PackedLayout) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """Group → weight key → (dtype, shape) of the views `runtime.weights.views.packed_views` gives the
    programs (a stacked tensor indexed by layer; the routed experts of one rank), without tensors."""
    out: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for group, params in packed.groups:
        w: dict[str, tuple[str, tuple[int, ...]]] = {}
        for p in params:
            slot = packed.slots[p.name]
            for name in slot.names:
                t = packed.tensors[name]
                # routed experts [ranks, layers, E/r, …] → one rank's [E/r, …]
                shape = t.shape[2:] if slot.rule.group == EXPERTS else t.shape[len(slot.index):]
                w.setdefault(slot.relative(name), (_DTYPE_NAMES[t.dtype], tuple(shape)))
        out[group] = w
    return out


@dataclass(frozen=True)
class ModelPrograms:
    """Every program spec of a deployment, and how the engine calls each group."""

    dims: Dims
    specs: dict[str, ProgramSpec]
    variants: dict[str, LayerVariant]
    cache_names: dict[str, tuple[str, ...]]  # variant name → cache row names
    weight_names: dict[str, tuple[str, ...]]  # program family → weight keys the engine passes, in order
    expert_parallel: bool = False  # ranks > 1: layers return FFN parts (model.ffn_out); `experts` runs the routed
    routed: str = ROUTED_APART  # the form: layer programs without their routed experts, or with them


def build_programs(config: DeepSeekV4Config, packed: PackedLayout, max_seq: int,
                   routed: str = ROUTED_APART) -> ModelPrograms:
    """Every program of a deployment. One rank in the `ROUTED_APART` form: a layer call (what the
    engine passes, `weight_names[variant]`) carries the layer program's inputs, then the routed
    experts' tensors for the experts program."""
    if routed not in (ROUTED_APART, ROUTED_IN_LAYER):
        raise ValueError(f"unknown program form {routed!r}")
    if routed == ROUTED_IN_LAYER and packed.ranks > 1:
        raise ValueError("several ranks exchange the routed experts' rows between layer and experts programs")
    d = Dims.of(config, max_seq)
    dims = d.to_json()
    shapes = weight_shapes(packed)
    variants = layer_variants(config)
    tokens_dim, rows_dim = DynamicDim("T", 1, max_seq), DynamicDim("B", 1, MAX_DECODE_ROWS)
    slots_dim = DynamicDim("S", 1, MAX_SLOTS)
    layout = {"ranks": packed.ranks, "max_seq": max_seq}
    parallel = packed.ranks > 1
    apart = routed == ROUTED_APART
    specs: dict[str, ProgramSpec] = {}
    cache_names: dict[str, tuple[str, ...]] = {}
    weight_names: dict[str, tuple[str, ...]] = {}

    # where the routed experts' native products are built (`experts.native`), so are the dense ones of
    # the programs' FP8 and BF16 products (`ops.dense_calls`)
    native_dense = apart and cxx() is not None

    def add(name: str, factory: str, captures: dict, inputs_for, slotted: bool = False,
            dense: bool = False) -> None:
        """Both modes of a program; a `slotted` one reads caches of every slot, and learns its mode;
        a `dense` one has FP8 or BF16 products (`dsv4::dense` calls, where native ones are built)."""
        for mode in MODES:
            rows = tokens_dim if mode == PREFILL else rows_dim
            mode_captures = {"prefill": mode == PREFILL} if slotted else {}
            if native_dense and dense:
                mode_captures["native_dense"] = True
            specs[f"{name}.{mode}"] = ProgramSpec(
                f"{name}.{mode}", f"{FNS}:{factory}", inputs_for(rows.name),
                dims=(rows, slots_dim) if slotted else (rows,),
                layout=layout, model_dims=dims, captures={"dims": dims, **captures, **mode_captures})

    def weights(prefix: str, w: dict, names) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(f"{prefix}{n}", *w[n]) for n in names)

    def act(t):
        return (TensorSpec("x", "float32", (t, d.hc, d.hidden)), TensorSpec("tokens", "int64", (t,)),
                TensorSpec("positions", "int64", (t,)), TensorSpec("slots", "int64", (t,)),
                TensorSpec("starts", "int64", (t,)))

    expert_shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    for group, v in variants.items():
        if v.name in cache_names:
            continue
        caches = tuple(cache_shapes(d, v.kind, v.ratio).items())
        cache_names[v.name] = tuple(n for n, _ in caches)
        w = shapes[group]
        engine_weights: tuple[str, ...] = ()  # passed beyond the layer program's (one rank: its experts)
        if apart:  # the routed experts are the `experts` programs' inputs, not the layer's
            routed_shapes = {n: s for n, s in w.items() if n.startswith(ROUTED_PREFIX)}
            if expert_shapes and routed_shapes != expert_shapes:
                raise ValueError(f"{group}: routed experts shaped unlike the other layers': {routed_shapes}")
            expert_shapes = routed_shapes
            w = {n: s for n, s in w.items() if n not in routed_shapes}
            engine_weights = () if parallel else tuple(sorted(routed_shapes))
        weight_names[v.name] = (*sorted(w), *engine_weights)
        cache_specs = tuple(TensorSpec(f"cache.{n}", "float32", ("S", *s)) for n, s in caches)
        captures = {"kind": v.kind, "ratio": v.ratio, "hash_routed": v.hash_routed,
                    "cache_names": list(cache_names[v.name]), "weight_names": sorted(w),
                    **({"experts_apart": True} if apart else {})}
        add(v.name, "layer", captures,
            lambda t, w=w, cache_specs=cache_specs: (*act(t), *cache_specs, *weights("w.", w, sorted(w))),
            slotted=True, dense=True)
    if apart:
        # rows of one rank's experts: a prefill's tokens (alone in its step), or every rank's decode rows
        rows = DynamicDim("M", 1, max(max_seq, packed.ranks * MAX_DECODE_ROWS))
        weight_names[EXPERTS_PROGRAM] = tuple(sorted(expert_shapes))
        if parallel:  # rows any rank sent: each row's share of its routed sum, for the row's rank
            head, finish = (TensorSpec("h", "float32", ("M", d.hidden)), TensorSpec("idx", "int64", ("M", d.topk)),
                            TensorSpec("weights", "float32", ("M", d.topk)),
                            TensorSpec("expert_base", "int64", ())), {}
        else:  # a layer program's FFN parts (`model.FFN_PARTS`), finished into the block's output
            head, finish = (TensorSpec("x", "float32", ("M", d.hc, d.hidden)),
                            TensorSpec("post", "float32", ("M", d.hc)),
                            TensorSpec("comb", "float32", ("M", d.hc, d.hc)),
                            TensorSpec("h", "float32", ("M", d.hidden)),
                            TensorSpec("idx", "int64", ("M", d.topk)), TensorSpec("weights", "float32", ("M", d.topk)),
                            TensorSpec("shared", "float32", ("M", d.hidden))), {"finish": True}
        specs[EXPERTS_PICKED] = ProgramSpec(
            EXPERTS_PICKED, f"{FNS}:experts", (*head, *weights("w.", expert_shapes, weight_names[EXPERTS_PROGRAM])),
            dims=(rows,), layout=layout, model_dims=dims,
            captures={"dims": dims, "weight_names": list(weight_names[EXPERTS_PROGRAM]), "picked": True, **finish})
        if native_dense:  # built from C++ source: a host with no compiler groups with the eager decode
            specs[EXPERTS_NATIVE] = replace(specs[EXPERTS_PICKED], name=EXPERTS_NATIVE, captures={
                "dims": dims, "weight_names": list(weight_names[EXPERTS_PROGRAM]), "native": True, **finish})

    top = shapes["top"]
    emb_spec = TensorSpec("embed.weight", *top["embed.weight"])
    add("embed", "embed", {}, lambda t: (TensorSpec("tokens", "int64", (t,)), emb_spec))
    weight_names["head"] = TOP_HEAD
    add("head", "head", {"weight_names": list(TOP_HEAD)},
        lambda t: (TensorSpec("x", "float32", (t, d.hc, d.hidden)), *weights("", top, TOP_HEAD)), dense=True)
    if config.num_nextn_predict_layers:
        mtp = shapes["mtp.0"]
        weight_names["mtp.input"] = MTP_INPUT
        add("mtp.input", "mtp_input", {"weight_names": list(MTP_INPUT)},
            lambda t: (TensorSpec("next_tokens", "int64", (t,)), TensorSpec("h", "float32", (t, d.hc, d.hidden)),
                       emb_spec, *weights("", mtp, MTP_INPUT)), dense=True)
        # the MTP head is the model head over MTP's own hc_head/norm and the shared head.weight
    return ModelPrograms(d, specs, variants, cache_names, weight_names, parallel, routed)


def kv_slot_bytes(programs: ModelPrograms) -> int:
    """Bytes of KV-cache state one sequence slot needs at the programs' max_seq (float32 rows)."""
    total = 0
    for v in programs.variants.values():
        for shape in cache_shapes(programs.dims, v.kind, v.ratio).values():
            n = 4
            for s in shape:
                n *= s
            total += n
    return total
