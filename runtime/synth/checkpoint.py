"""Structurally faithful synthetic DeepSeek V4 checkpoints.

Real tensor names, dtypes, quantisation formats, layer kinds and index layout at shrunk
dimensions, so loading, packing, caching and serving run unchanged on them. Every tensor is a
real quantisation of a float tensor drawn from a generator seeded by (seed, tensor name): the
output is byte-identical for the same preset and seed, whatever the shard count.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from runtime.model.config import DeepSeekV4Config, from_dict
from runtime.model.tensors import BF16, F32, FP4, FP8, I64, Param, params_by_group, stored_tensors
from runtime.model.tokenizer import TOKENIZER_NAME
from runtime.synth.tokenizer import TOKENIZER_CONFIG_NAME, tokenizer_config, train_tokenizer_json
from store.atomic import fsync_dir, staged_file, write_bytes_atomic
from store.checkpoint import CONFIG_NAME, INDEX_NAME
from store.errors import UserError
from store.fingerprint import sha256_hex
from store.paths import default_model_dir, default_preset
from store.quant import quant_fp4, quant_fp8_block

# The released V4-Flash config.json (see DSV4_CHECKPOINT.md); presets shrink its dimensions.
V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "hidden_size": 4096, "num_hidden_layers": 43, "vocab_size": 129280,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8,
    "sliding_window": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0, "num_hash_layers": 3, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "num_nextn_predict_layers": 1, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0],
    "bos_token_id": 0, "eos_token_id": 1,
}

_PRESET_DIMS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 256, "num_hidden_layers": 5, "vocab_size": 512,
        "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 128,
        "o_lora_rank": 64, "o_groups": 2, "sliding_window": 16, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "num_hash_layers": 2,
        "index_n_heads": 16, "index_head_dim": 32, "index_topk": 8,
        "max_position_embeddings": 4096, "compress_ratios": [0, 0, 4, 16, 4, 0],
        "block": 32,
    },
    "small": {
        "hidden_size": 1024, "num_hidden_layers": 11, "vocab_size": 32768,
        "num_attention_heads": 16, "head_dim": 128, "qk_rope_head_dim": 32, "q_lora_rank": 512,
        "o_lora_rank": 256, "o_groups": 4, "sliding_window": 64, "n_routed_experts": 32,
        "num_experts_per_tok": 4, "moe_intermediate_size": 512, "num_hash_layers": 3,
        "index_n_heads": 16, "index_head_dim": 64, "index_topk": 64,
        "max_position_embeddings": 65536, "compress_ratios": [0, 0] + [4, 128] * 4 + [4] + [0],
        "block": 128,
    },
    "medium": {
        "hidden_size": 2048, "num_hidden_layers": 21, "vocab_size": 32768,
        "num_attention_heads": 32, "head_dim": 128, "qk_rope_head_dim": 32, "q_lora_rank": 768,
        "o_lora_rank": 512, "o_groups": 4, "sliding_window": 128, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "moe_intermediate_size": 768, "num_hash_layers": 3,
        "index_n_heads": 32, "index_head_dim": 64, "index_topk": 128,
        "max_position_embeddings": 131072, "compress_ratios": [0, 0] + [4, 128] * 9 + [4] + [0],
        "block": 128,
    },
}
PRESETS = tuple(_PRESET_DIMS)
DEFAULT_SHARDS = {"tiny": 3, "small": 4, "medium": 8}


def preset_config_dict(preset: str, seed: int = 0) -> dict[str, Any]:
    """The full config.json content of a preset."""
    if preset not in _PRESET_DIMS:
        raise UserError(f"unknown preset '{preset}'; choose one of {', '.join(PRESETS)}")
    dims = dict(_PRESET_DIMS[preset])
    block = dims.pop("block")
    cfg = copy.deepcopy(V4_FLASH)
    cfg.update(dims)
    cfg["quantization_config"]["weight_block_size"] = [block, block]
    # the layer kinds and rates named too, as transformers reads them (it maps only 0/4/128)
    cfg.update(from_dict(cfg, source=f"preset {preset}").transformers_fields())
    cfg["dsv4_synthetic"] = {"preset": preset, "seed": seed}
    return cfg


def preset_config(preset: str, seed: int = 0) -> DeepSeekV4Config:
    return from_dict(preset_config_dict(preset, seed), source=f"preset {preset}")


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(sha256_hex(f"{seed}:{name}")[:15], 16))
    return g


def synth_param(c: DeepSeekV4Config, p: Param, seed: int) -> dict[str, torch.Tensor]:
    """The stored tensor(s) of one parameter: a float draw, quantised to its format."""
    g = _generator(seed, p.name)
    if p.init == "tid2eid":
        vocab, k = p.shape
        scores = torch.rand(vocab, c.n_routed_experts, generator=g)
        return {p.name: scores.argsort(dim=1)[:, :k].contiguous().to(torch.int64)}
    x = torch.randn(p.shape, generator=g)
    if p.init == "linear":
        x = x / (p.shape[-1] ** 0.5)
    elif p.init == "norm":
        x = 1.0 + 0.05 * x
    elif p.init == "small":
        x = 0.02 * x
    elif p.init == "gate_bias":
        x = 0.01 * x
    elif p.init == "scale_one":
        x = torch.ones(p.shape)
    if p.fmt == FP8:
        q, s = quant_fp8_block(x, c.fp8_block)
        return {p.name: q, p.scale_name: s}
    if p.fmt == FP4:
        q, s = quant_fp4(x, c.fp4_group)
        return {p.name: q, p.scale_name: s}
    dtype = {BF16: torch.bfloat16, F32: torch.float32, I64: torch.int64}[p.fmt]
    return {p.name: x.to(dtype).contiguous()}


def _plan_shards(c: DeepSeekV4Config, shards: int) -> list[list[Param]]:
    """Split parameters, in canonical order and never splitting a group, into ~equal shards."""
    groups = [(g, sum(t.nbytes for p in ps for t in stored_tensors(c, p))) for g, ps in params_by_group(c)]
    shards = max(1, min(shards, len(groups)))
    total = sum(n for _, n in groups)
    out: list[list[Param]] = [[] for _ in range(shards)]
    done, by_name = 0, dict(params_by_group(c))
    for g, n in groups:
        # shard index by the byte midpoint of the group, so big groups land evenly
        i = min(shards - 1, int((done + n / 2) * shards / total))
        out[i].extend(by_name[g])
        done += n
    return [s for s in out if s]


ProgressFn = Callable[[int, int, str], None]


def _prepare_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UserError(f"{out}: directory is not empty; pass --force to overwrite the checkpoint in it")
        # Drop the index first: a half-replaced directory must never look like a checkpoint.
        for name in (INDEX_NAME, CONFIG_NAME, TOKENIZER_NAME):
            with contextlib.suppress(FileNotFoundError):
                (out / name).unlink()
        for f in out.glob("model-*-of-*.safetensors"):
            f.unlink()
    out.mkdir(parents=True, exist_ok=True)


def synthesize(preset: str, out_dir: str | Path, *, seed: int = 0, shards: int | None = None,
               force: bool = False, progress: ProgressFn | None = None) -> Path:
    """Write a synthetic checkpoint; config and index go last, so a crash leaves no checkpoint."""
    out = Path(out_dir)
    cfg_dict = preset_config_dict(preset, seed)
    c = from_dict(cfg_dict, source=f"preset {preset}")
    plan = _plan_shards(c, shards or DEFAULT_SHARDS[preset])
    _prepare_out_dir(out, force)
    total = sum(t.nbytes for ps in plan for p in ps for t in stored_tensors(c, p))
    done, weight_map = 0, {}
    for i, params in enumerate(plan, start=1):
        name = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for p in params:
            tensors.update(synth_param(c, p, seed))
            done += sum(t.nbytes for t in stored_tensors(c, p))
            if progress:
                progress(done, total, p.name)
        with staged_file(out / name, mode=0o644) as (_, f):
            f.write(st_save(tensors, metadata={"format": "pt"}))
        weight_map.update({n: name for n in tensors})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    # a real checkpoint's tokenizer path: tokenizer.json, trained here on the shipped corpus
    write_bytes_atomic(out / TOKENIZER_NAME, train_tokenizer_json(c.vocab_size).encode(), mode=0o644)
    tok_config = json.dumps(tokenizer_config(c.max_position_embeddings), indent=2, ensure_ascii=False) + "\n"
    write_bytes_atomic(out / TOKENIZER_CONFIG_NAME, tok_config.encode(), mode=0o644)
    write_bytes_atomic(out / CONFIG_NAME, (json.dumps(cfg_dict, indent=2) + "\n").encode(), mode=0o644)
    write_bytes_atomic(out / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode(), mode=0o644)
    fsync_dir(out)
    return out


def ensure_default_model(preset: str | None = None, seed: int = 0,
                         progress: ProgressFn | None = None) -> tuple[Path, bool]:
    """The embedded default checkpoint, created on first use. Returns (path, created)."""
    preset = preset or default_preset()
    path = default_model_dir(preset, seed)
    if (path / INDEX_NAME).is_file():
        return path, False
    synthesize(preset, path, seed=seed, force=True, progress=progress)
    os.sync()
    return path, True
