"""The independent peer: Hugging Face transformers' `DeepseekV4ForCausalLM` on our checkpoint.

Built from a `DeepseekV4Config` equivalent to the checkpoint's config.json and loaded with
`from_pretrained` from a float32 copy of the checkpoint under its official tensor names
(transformers' own name mapping does the rest), made with our dequantisation: the same numbers
our service runs, in the peer's code. tests/test_parity.py uses it as the oracle of the forward
pass, `dsv4 bench peer` as the baseline of speed. transformers is a test extra (pinned there):
`require_transformers` says so in one line where it is missing.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from runtime.model.config import DeepSeekV4Config
    from store.checkpoint import Checkpoint


def require_transformers(who: str) -> None:
    """SystemExit with one line when transformers (with DeepseekV4) cannot be imported."""
    try:
        from transformers import DeepseekV4ForCausalLM  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{who}: needs Hugging Face transformers with DeepseekV4ForCausalLM ({e}); "
                         "install the test extra: pip install -e '.[test]'") from None


def _peer_types() -> dict[str, str]:
    from runtime.model.config import CSA, HCA, SLIDING

    return {SLIDING: "sliding_attention", CSA: "compressed_sparse_attention", HCA: "heavily_compressed_attention"}


def peer_config(c: DeepSeekV4Config, kinds: list[str] | None = None,
                hash_layers: int | None = None) -> DeepseekV4Config:
    """The transformers config equivalent to ours. Layer kinds and compress rates are passed
    explicitly (the peer maps legacy `compress_ratios` only for V4's own 0/4/128); the rope
    scaling dict is handed over as is, which the peer turns into YaRN on compressed layers."""
    from transformers import DeepseekV4Config

    from runtime.model import forward as M
    from runtime.model.config import SLIDING

    types = _peer_types()
    kinds = kinds if kinds is not None else list(c.layer_kinds)
    n_hash = c.num_hash_layers if hash_layers is None else hash_layers
    rates = {types[k]: c.compress_ratios[i] for i, k in enumerate(c.layer_kinds) if k != SLIDING}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return DeepseekV4Config(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, moe_intermediate_size=c.moe_intermediate_size,
            num_hidden_layers=len(kinds), num_attention_heads=c.num_attention_heads, num_key_value_heads=1,
            head_dim=c.head_dim, q_lora_rank=c.q_lora_rank, num_experts_per_tok=c.num_experts_per_tok,
            n_routed_experts=c.n_routed_experts, n_shared_experts=c.n_shared_experts,
            scoring_func=c.scoring_func, norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor, max_position_embeddings=c.max_position_embeddings,
            rope_theta=c.rope_theta, compress_rope_theta=c.compress_rope_theta,
            layer_types=[types[k] for k in kinds], compress_rates=rates,
            mlp_layer_types=["hash_moe" if i < n_hash else "moe" for i in range(len(kinds))],
            hc_mult=c.hc_mult, hc_sinkhorn_iters=c.hc_sinkhorn_iters, hc_eps=c.hc_eps,
            swiglu_limit=c.swiglu_limit, sliding_window=c.sliding_window, o_groups=c.o_groups,
            o_lora_rank=c.o_lora_rank, index_n_heads=c.index_n_heads, index_head_dim=c.index_head_dim,
            index_topk=c.index_topk, num_nextn_predict_layers=c.num_nextn_predict_layers,
            partial_rotary_factor=c.qk_rope_head_dim / c.head_dim, rope_parameters=dict(c.rope_scaling),
            rms_norm_eps=M.NORM_EPS, tie_word_embeddings=False)


def float_weights(ck: Checkpoint, c: DeepSeekV4Config) -> dict[str, torch.Tensor]:
    """Every parameter under its checkpoint name, dequantised to float32 [out, in] by our code."""
    from runtime.model.tensors import I64, all_params
    from runtime.weights.pack import dequantize

    return {p.name: ck.read(p.name) if p.fmt == I64 else dequantize(ck, c, p).contiguous() for p in all_params(c)}


def load_peer(out: Path, config: DeepseekV4Config, tensors: dict[str, torch.Tensor]) -> DeepseekV4ForCausalLM:
    """`tensors` saved under `out` with `config`, loaded by `from_pretrained` (float32, eval);
    an AssertionError naming what did not load by name."""
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM

    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer, info = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), f"the peer did not load every weight by name: {info}"
    return peer.eval()


def main_model_peer(model_dir: Path, out: Path, weights: dict[str, Any] | None = None) -> DeepseekV4ForCausalLM:
    """The peer of the checkpoint's main model (transformers drops the MTP layer), its copy under
    `out`; `weights`: `float_weights` of it, when the caller already has them. Its generation
    config stops at no token (as a request with `ignore_eos`)."""
    from runtime.model.config import load_config
    from store.checkpoint import Checkpoint

    c = load_config(model_dir)
    if weights is None:  # made here, only the main model's are kept (on small: GiBs of float32)
        ck = Checkpoint.open(model_dir)
        try:
            weights = float_weights(ck, c)
        finally:
            ck.close()
    main = {n: t for n, t in weights.items() if not n.startswith("mtp.")}
    weights = None
    peer = load_peer(out, peer_config(c), main)
    peer.generation_config.eos_token_id = None
    peer.generation_config.pad_token_id = 0
    return peer
