"""DeepSeek V4 `config.json` as a frozen, validated value, plus the facts derived from it.

No torch here: the console reads configs too. Nothing assumes V4-Flash dimensions; every size
comes from the file, so the synthetic presets and the real model run the same code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from store import safeio
from store.checkpoint import MAX_JSON_BYTES
from store.errors import UserError

SLIDING, CSA, HCA = "sliding", "csa", "hca"
# V4 uses ratio 4 for CSA (overlapping compressor + indexer) and 128 for HCA (compressor only).
# V4's own config.json names no kind (`compress_ratios` only), so there the kind follows the
# ratio: a few tokens per entry is CSA, many is HCA (the tiny preset's 16 stays HCA). A config
# that names them (transformers' `layer_types` + `compress_rates`, as `dsv4 synth` writes too)
# is read as it says.
CSA_MAX_RATIO = 8
# transformers' DeepseekV4Config layer types ↔ ours
LAYER_TYPES = {"sliding_attention": SLIDING, "compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA}
TYPE_OF_KIND = {kind: name for name, kind in LAYER_TYPES.items()}
DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


class ConfigError(UserError):
    """config.json is missing, malformed, or inconsistent; the message names file and field."""


@dataclass(frozen=True)
class DeepSeekV4Config:
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    num_hash_layers: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int
    rope_theta: float
    compress_rope_theta: float
    rope_scaling: dict
    max_position_embeddings: int
    expert_dtype: str
    quantization_config: dict
    compress_ratios: tuple[int, ...]
    model_type: str = "deepseek_v4"
    layer_types: tuple[str, ...] = ()  # each main layer's kind when the config names them (ours: sliding/csa/hca)
    # Where it was read from, for error messages; not part of equality.
    source: str = field(default="config.json", compare=False)
    # The preset of a checkpoint `dsv4 synth` wrote (its `dsv4_synthetic` key), else None: what
    # `--speculative auto` and the launch history ask, answered from the one read of the file.
    synthetic: str | None = field(default=None, compare=False)

    # ---- derived facts ----

    @property
    def num_layers_total(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def layer_kind(self, layer: int) -> str:
        """Kind of main layer `layer`, or of MTP layer `layer - num_hidden_layers`."""
        if layer < len(self.layer_types):
            return self.layer_types[layer]
        ratio = self.compress_ratios[layer]
        if ratio == 0:
            return SLIDING
        return CSA if ratio <= CSA_MAX_RATIO else HCA

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_hidden_layers))

    @property
    def mtp_kinds(self) -> tuple[str, ...]:
        return tuple(self.layer_kind(self.num_hidden_layers + i) for i in range(self.num_nextn_predict_layers))

    @property
    def hash_layers(self) -> tuple[int, ...]:
        return tuple(range(min(self.num_hash_layers, self.num_hidden_layers)))

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == SLIDING)

    @property
    def csa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == CSA)

    @property
    def hca_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == HCA)

    @property
    def fp8_block(self) -> tuple[int, int]:
        b = self.quantization_config.get("weight_block_size", [128, 128])
        return int(b[0]), int(b[1])

    @property
    def fp4_group(self) -> int:
        """Inputs sharing one E8M0 scale in FP4 expert weights."""
        return 32

    @property
    def hc_mix_dim(self) -> int:
        """Rows of hc_attn_fn / hc_ffn_fn: pre weights, post weights and the combine matrix."""
        return (2 + self.hc_mult) * self.hc_mult

    def check_ranks(self, ranks: int) -> None:
        if ranks < 1 or self.n_routed_experts % ranks:
            raise ConfigError(
                f"{self.source}: n_routed_experts={self.n_routed_experts} is not divisible by "
                f"ranks={ranks}; pick a rank count that divides the expert count"
            )

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in APART}
        out["compress_ratios"] = list(self.compress_ratios)
        if self.layer_types:
            out["layer_types"] = list(self.layer_types)
        return out

    def transformers_fields(self) -> dict[str, Any]:
        """What transformers' DeepseekV4Config reads for the layer kinds and compression rates
        (explicit, beside `compress_ratios`: it maps only V4's own 0/4/128 ratios itself)."""
        rates = {TYPE_OF_KIND[self.layer_kind(i)]: self.compress_ratios[i] for i in range(self.num_hidden_layers)
                 if self.layer_kind(i) != SLIDING}
        return {"layer_types": [TYPE_OF_KIND[k] for k in self.layer_kinds], "compress_rates": rates}

    def summary(self) -> dict[str, Any]:
        return {
            "layers": self.num_hidden_layers,
            "sliding_layers": len(self.sliding_layers),
            "csa_layers": len(self.csa_layers),
            "hca_layers": len(self.hca_layers),
            "hash_layers": len(self.hash_layers),
            "mtp_layers": self.num_nextn_predict_layers,
            "experts": self.n_routed_experts,
            "experts_per_token": self.num_experts_per_tok,
            "hidden": self.hidden_size,
            "vocab": self.vocab_size,
        }


_TYPES: dict[str, tuple[type, ...]] = {"int": (int,), "float": (int, float), "str": (str,),
                                       "bool": (bool,), "dict": (dict,)}


def _field_type(f) -> str:
    t = f.type if isinstance(f.type, str) else f.type.__name__
    return "tuple" if t.startswith("tuple") else t


APART = ("source", "layer_types", "synthetic")  # not plain fields of the JSON: read and written on their own


def from_dict(raw: Any, source: str = "config.json") -> DeepSeekV4Config:
    """Validate a parsed config.json; every problem names `source` and the field."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object at top level")
    values: dict[str, Any] = {}
    raw = _named_layer_types(raw, source)
    for f in fields(DeepSeekV4Config):
        if f.name in APART:
            continue
        if f.name not in raw:
            if f.name == "model_type":
                continue
            raise ConfigError(f"{source}: missing field '{f.name}'")
        v = raw[f.name]
        kind = _field_type(f)
        if kind == "tuple":
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise ConfigError(f"{source}: field '{f.name}' must be a list of integers, got {v!r}")
            v = tuple(v)
        else:
            ok = isinstance(v, _TYPES[kind]) and (kind == "bool" or not isinstance(v, bool))
            if not ok:
                raise ConfigError(f"{source}: field '{f.name}' must be {kind}, got {type(v).__name__} {v!r}")
            if kind == "float":
                try:
                    v = float(v)
                except OverflowError:
                    raise ConfigError(f"{source}: field '{f.name}' = {str(v)[:24]}… is too large for a float") from None
        values[f.name] = v
    synthetic = raw.get("dsv4_synthetic")
    preset = synthetic.get("preset") if isinstance(synthetic, dict) else None
    cfg = DeepSeekV4Config(**values, layer_types=raw.get("layer_types", ()), source=source,
                           synthetic=preset if isinstance(preset, str) else None)
    _check_consistency(cfg)
    return cfg


def _named_layer_types(raw: dict, source: str) -> dict:
    """transformers' form: `layer_types` (one per main layer) and `compress_rates` (one per
    compressed type) → our kinds, and `compress_ratios` derived where the config has none (MTP
    layers: sliding, ratio 0). Both forms given must agree."""
    names = raw.get("layer_types")
    if names is None:
        return raw
    n = raw.get("num_hidden_layers")
    lo, hi = RANGES["num_hidden_layers"]
    if not isinstance(n, int) or isinstance(n, bool) or not lo <= n <= hi:
        # the layer count itself is wrong: that is the line to say (from_dict's checks)
        return {k: v for k, v in raw.items() if k != "layer_types"}
    if not isinstance(names, list) or not all(isinstance(t, str) and t in LAYER_TYPES for t in names):
        raise ConfigError(f"{source}: field 'layer_types' must be a list of {', '.join(LAYER_TYPES)}, "
                          f"got {names!r}"[:300])
    if len(names) != n:
        raise ConfigError(f"{source}: field 'layer_types' has {len(names)} entries, expected num_hidden_layers ({n!r})")
    rates = raw.get("compress_rates", DEFAULT_COMPRESS_RATES)
    if not isinstance(rates, dict) or not all(
            k in DEFAULT_COMPRESS_RATES and isinstance(v, int) and not isinstance(v, bool)
            and 0 < v <= MAX_COMPRESS_RATIO
            for k, v in rates.items()):
        raise ConfigError(f"{source}: field 'compress_rates' must map {' / '.join(DEFAULT_COMPRESS_RATES)} to "
                          f"ratios in 1..{MAX_COMPRESS_RATIO}, got {rates!r}"[:300])
    rates = {**DEFAULT_COMPRESS_RATES, **rates}
    derived = [0 if t == "sliding_attention" else rates[t] for t in names]
    ratios = raw.get("compress_ratios")
    if ratios is None:
        nextn = raw.get("num_nextn_predict_layers", 0)
        ratios = derived + [0] * (nextn if isinstance(nextn, int) and 0 <= nextn <= 16 else 0)
    elif not isinstance(ratios, list) or list(ratios[:len(derived)]) != derived:
        raise ConfigError(f"{source}: field 'compress_ratios' {ratios!r} disagrees with 'layer_types' and "
                          f"'compress_rates' (they give {derived}); fix one of them"[:400])
    return {**raw, "compress_ratios": ratios, "layer_types": tuple(LAYER_TYPES[t] for t in names)}


# Allowed ranges, checked before anything allocates or loops on a value: generous around every
# released V4 config (V4-Flash and V4-Pro fit with room), tight enough that a typo or a hostile
# file (a negative layer count, a million Sinkhorn iterations) is one line, not a hang.
RANGES: dict[str, tuple[float, float]] = {
    "hidden_size": (32, 1 << 16), "num_hidden_layers": (1, 1024), "vocab_size": (258, 1 << 22),
    "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024), "head_dim": (2, 4096),
    "qk_rope_head_dim": (0, 4096), "q_lora_rank": (1, 1 << 16), "o_lora_rank": (1, 1 << 16),
    "o_groups": (1, 1024), "sliding_window": (1, 1 << 20), "n_routed_experts": (1, 4096),
    "n_shared_experts": (0, 64), "num_experts_per_tok": (1, 4096), "moe_intermediate_size": (32, 1 << 17),
    "routed_scaling_factor": (1e-6, 1e3), "swiglu_limit": (1e-6, 1e6), "num_hash_layers": (0, 1024),
    "hc_mult": (1, 16), "hc_sinkhorn_iters": (0, 1000), "hc_eps": (1e-30, 1.0),
    "index_n_heads": (1, 1024), "index_head_dim": (2, 4096), "index_topk": (1, 1 << 20),
    "num_nextn_predict_layers": (0, 16), "rope_theta": (1.0, 1e12), "compress_rope_theta": (1.0, 1e12),
    "max_position_embeddings": (1, 1 << 26),
}  # fmt: skip
MAX_COMPRESS_RATIO = 1 << 16
MAX_BLOCK = 1 << 16


def _span(lo: float, hi: float) -> str:
    return f"{lo:g}..{hi:g}" if isinstance(lo, float) or isinstance(hi, float) else f"{lo}..{hi}"


def _check_ranges(c: DeepSeekV4Config) -> None:
    for name, (lo, hi) in RANGES.items():
        v = getattr(c, name)
        if not lo <= v <= hi:  # NaN fails both comparisons
            raise ConfigError(f"{c.source}: field '{name}' = {v!r} is out of range; allowed {_span(lo, hi)}")
    bad = [r for r in c.compress_ratios if not 0 <= r <= MAX_COMPRESS_RATIO]
    if bad:
        raise ConfigError(f"{c.source}: field 'compress_ratios' holds {bad[0]}, out of range; "
                          f"allowed 0..{MAX_COMPRESS_RATIO} (0 = sliding window)")


def _check_consistency(c: DeepSeekV4Config) -> None:
    def fail(fieldname: str, why: str) -> None:
        raise ConfigError(f"{c.source}: field '{fieldname}' {why}")

    if c.model_type != "deepseek_v4":
        fail("model_type", f"is {c.model_type!r}, expected 'deepseek_v4'")
    _check_ranges(c)
    if len(c.compress_ratios) != c.num_layers_total:
        fail("compress_ratios", f"has {len(c.compress_ratios)} entries, expected num_hidden_layers + "
             f"num_nextn_predict_layers = {c.num_layers_total}")
    if (c.num_attention_heads * c.head_dim) % c.o_groups:
        fail("o_groups", f"={c.o_groups} does not divide num_attention_heads·head_dim = "
             f"{c.num_attention_heads * c.head_dim}")
    if c.num_attention_heads % c.o_groups:
        fail("o_groups", f"={c.o_groups} does not divide num_attention_heads={c.num_attention_heads}")
    if c.num_experts_per_tok > c.n_routed_experts:
        fail("num_experts_per_tok", f"={c.num_experts_per_tok} exceeds n_routed_experts={c.n_routed_experts}")
    if c.qk_rope_head_dim > c.head_dim or c.qk_rope_head_dim % 2:
        fail("qk_rope_head_dim", f"={c.qk_rope_head_dim} must be even and at most head_dim={c.head_dim}")
    if c.index_head_dim % 2 or c.index_head_dim < c.qk_rope_head_dim:
        fail("index_head_dim", f"={c.index_head_dim} must be even and at least qk_rope_head_dim")
    for name in ("hidden_size", "moe_intermediate_size"):
        if getattr(c, name) % 32:
            fail(name, "must be a multiple of 32 (FP4 experts carry one scale per 32 inputs)")
    if c.num_hash_layers > c.num_hidden_layers:
        fail("num_hash_layers", f"={c.num_hash_layers} exceeds num_hidden_layers={c.num_hidden_layers}")
    if c.expert_dtype not in ("fp4", "fp8"):
        fail("expert_dtype", f"is {c.expert_dtype!r}, expected 'fp4' or 'fp8'")
    qc = c.quantization_config
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_BLOCK for b in block)):
        fail("quantization_config.weight_block_size", f"must be two integers in 1..{MAX_BLOCK}, got {block!r}")
    if qc.get("quant_method") != "fp8":
        fail("quantization_config.quant_method", f"is {qc.get('quant_method')!r}, expected 'fp8'")
    if c.scoring_func != "sqrtsoftplus":
        fail("scoring_func", f"is {c.scoring_func!r}; this runtime implements 'sqrtsoftplus'")
    _check_layer_types(c, fail)
    _check_rope_scaling(c, fail)


def _check_layer_types(c: DeepSeekV4Config, fail) -> None:
    """V4 has one compress ratio per layer type (CSA, HCA; transformers' `compress_rates`): a
    layer whose ratio differs from the others of its kind has no layer type to run as."""
    first: dict[str, tuple[int, int]] = {}
    for i, r in enumerate(c.compress_ratios):
        kind = c.layer_kind(i)
        if kind == SLIDING:
            continue
        layer, ratio = first.setdefault(kind, (i, r))
        if r != ratio:
            fail("compress_ratios", f"gives layer {i} ratio {r} but layer {layer} ratio {ratio}, both "
                 f"{kind.upper()}: a V4 layer type has one compress ratio, so {r} has no layer type")


YARN_KEYS = ("factor", "original_max_position_embeddings")


def _check_rope_scaling(c: DeepSeekV4Config, fail) -> None:
    """No scaling, or YaRN (applied to compressed layers only); any other kind is refused rather
    than run with different position numerics."""
    rs = c.rope_scaling
    if not rs:
        return
    kind = rs.get("type", rs.get("rope_type"))
    if kind == "default":
        return
    if kind != "yarn":
        fail("rope_scaling.type", f"is {kind!r}; this runtime implements 'yarn' or 'default' (or no rope_scaling)")
    for key in YARN_KEYS:
        v = rs.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not v >= 1:
            fail(f"rope_scaling.{key}", f"must be a number >= 1 for YaRN, got {v!r}")
    if not isinstance(rs["original_max_position_embeddings"], int):
        fail("rope_scaling.original_max_position_embeddings", "must be an integer")
    for key in ("beta_fast", "beta_slow"):
        v = rs.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not v > 0):
            fail(f"rope_scaling.{key}", f"must be a positive number, got {v!r}")


def load_config(path: str | Path) -> DeepSeekV4Config:
    """Read `path` (a config.json, or a checkpoint dir holding one)."""
    return read_config(path)[1]


def read_config(path: str | Path) -> tuple[bytes, DeepSeekV4Config]:
    """config.json's bytes and what they say, from one read: a launch parses, keys and hashes the
    same bytes (`runtime.launch.plan.resolve`), never a file rewritten between two reads."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:  # a regular file only, opened without blocking (a FIFO there never hangs a launch)
        data = safeio.read_regular(p, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise ConfigError(f"{p}: no config.json here; point at a DeepSeek V4 checkpoint directory") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read it ({e.strerror or e}); point at a DeepSeek V4 checkpoint "
                          f"directory") from None
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: malformed JSON ({e})") from None
    return data, from_dict(raw, source=str(p))
