"""Parity with an independent implementation: Hugging Face transformers' DeepseekV4ForCausalLM.

The peer is built from a `DeepseekV4Config` equivalent to the tiny checkpoint's config.json and
loaded with `from_pretrained` from a float32 copy of the checkpoint under its official tensor
names (transformers' own name mapping does the rest), made with our dequantisation. Our side
runs the float reference view of the same checkpoint. Same numbers in, so any difference is a
difference of the forward pass: the bound is float32 rounding (relative L2 ≤ 1e-4; observed
~1e-6) and every greedy argmax agrees.

The prompts exercise every attention path: shorter and longer than the sliding window, CSA
layers whose indexer has more visible compressed entries than index_topk (so top-k selects),
and HCA entries. Hidden states are compared after every block, so a regression names it.

MTP: transformers does not implement the MTP layer (it drops `mtp.*` on load), so it cannot
be the oracle there. The MTP test builds it from the peer's own building blocks instead: a
one-layer peer whose block, hc head and final norm carry the MTP weights, fed with DeepSeek's
MTP input (e_proj(enorm(embed(next token))) + h_proj(hnorm(x)) per hc stream, x the main
model's last hc residual stream) computed with the peer's RMSNorm. What that proves: our MTP
runs the same block, head and norms on that input; the input wiring itself is DeepSeek's
reference convention, which no installed implementation can confirm.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from bench.hf_peer import float_weights, load_peer, main_model_peer, peer_config
from runtime.engine.engine import Engine
from runtime.model import forward as M
from runtime.model.config import CSA, HCA, DeepSeekV4Config, load_config
from runtime.programs.catalog import build_programs
from runtime.weights.pack import PackedLayout
from runtime.weights.views import reference_views
from store.checkpoint import Checkpoint

if TYPE_CHECKING:  # imported where a test runs: collecting this module never loads transformers
    from transformers import DeepseekV4ForCausalLM

pytestmark = pytest.mark.slow

MAX_SEQ = 128
REL = 1e-4
MTP_LOCAL = ("enorm.weight", "hnorm.weight", "e_proj.weight", "h_proj.weight")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _prompt(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def setup(tiny_ckpt_ro, tmp_path_factory):
    ck = Checkpoint.open(tiny_ckpt_ro)
    c = load_config(tiny_ckpt_ro)
    layout = PackedLayout(c, ranks=1)
    programs = build_programs(c, layout, max_seq=MAX_SEQ)
    weights = float_weights(ck, c)
    base = tmp_path_factory.mktemp("peer")
    peer = main_model_peer(tiny_ckpt_ro, base / "main", weights)
    return c, programs, reference_views(ck, layout), peer, weights, base


def _peer_prefill(peer: DeepseekV4ForCausalLM, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Peer logits [T, V] and the hc residual stream after each block ([T, hc, D] each)."""
    streams: list[torch.Tensor] = [None] * len(peer.model.layers)
    hooks = [layer.register_forward_hook(lambda _m, _a, out, i=i: streams.__setitem__(i, out[0]))
             for i, layer in enumerate(peer.model.layers)]
    try:
        with torch.no_grad():
            logits = peer(tokens[None], use_cache=False).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return logits, streams


def _our_prefill(programs, weights, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    engine = Engine(programs, weights)
    d, positions = programs.dims, torch.arange(tokens.shape[0])
    rows = M.Rows(positions, torch.zeros_like(positions), torch.zeros_like(positions))  # slot 0, from 0
    x, streams = M.embed(d, weights["top"], tokens), []
    for group, v in programs.variants.items():
        if group.startswith("layers."):
            x, _ = M.block(d, v.kind, v.ratio, v.hash_routed, weights[group], x, tokens, rows,
                           engine.caches[group], prefill=True)
            streams.append(x)
    return M.head(d, weights["top"], x)[0], streams


# (length, seed): shorter than the window; past the window with a few top-k selections; long:
# every CSA query past position 35 has more visible entries than index_topk, 7 HCA entries
PROMPTS = [(12, 1), (40, 2), (112, 3)]


def test_the_prompts_exercise_window_topk_and_hca(setup):
    c, programs, *_ = setup
    d = programs.dims
    longest = max(n for n, _ in PROMPTS)
    assert min(n for n, _ in PROMPTS) < d.window < longest
    csa_ratio = next(r for r, k in zip(c.compress_ratios, c.layer_kinds, strict=False) if k == CSA)
    hca_ratio = next(r for r, k in zip(c.compress_ratios, c.layer_kinds, strict=False) if k == HCA)
    assert longest // csa_ratio > 2 * d.index_topk  # the indexer picks 8 of up to 28 entries
    assert longest // hca_ratio >= 4


@pytest.mark.parametrize(("n", "seed"), PROMPTS)
def test_prefill_logits_and_every_block_match_the_peer(setup, n, seed):
    c, programs, ref, peer, *_ = setup
    tokens = _prompt(n, seed, c.vocab_size)
    want, want_streams = _peer_prefill(peer, tokens)
    got, got_streams = _our_prefill(programs, ref, tokens)
    for i, (a, b) in enumerate(zip(got_streams, want_streams, strict=True)):
        kind = c.layer_kind(i)
        assert _rel(a, b) <= REL, f"block {i} ({kind}, ratio {c.compress_ratios[i]}): relative L2 {_rel(a, b):.2e}"
    assert _rel(got, want) <= REL
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # and the engine (the serving driver) computes the same logits
    assert _rel(Engine(programs, ref).forward(tokens).logits, want) <= REL


def test_incremental_decode_matches_the_peer_cached_decode(setup):
    """Prefill a prompt that ends mid-window, then decode token by token on both sides: the
    peer through its own cache (sliding window, compressor buffers, overlap state), ours
    through the fixed-size caches. 27 steps cross seven CSA window closes (with top-k
    selection: more than index_topk entries visible) and the HCA window closing at 63."""
    c, programs, ref, peer, *_ = setup
    tokens, prefill = _prompt(64, 4, c.vocab_size), 37
    with torch.no_grad():
        out = peer(tokens[None, :prefill], use_cache=True)
        cache, want = out.cache, [out.logits[0]]
        for i in range(prefill, len(tokens)):
            want.append(peer(tokens[None, i:i + 1], cache=cache, use_cache=True).logits[0])
    engine = Engine(programs, ref)
    got = [engine.forward(tokens[:prefill]).logits]
    got += [engine.forward(tokens[i:i + 1]).logits for i in range(prefill, len(tokens))]
    got, want = torch.cat(got), torch.cat(want)
    assert _rel(got, want) <= REL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_yarn_is_applied_on_compressed_layers_and_the_comparison_sees_it(setup):
    """Without YaRN (or with it on every layer) the logits leave the peer's by far more than
    the bound: the comparison above is sensitive to where and whether YaRN applies."""
    c, programs, ref, peer, *_ = setup
    assert programs.dims.rope_factor == c.rope_scaling["factor"] > 1
    tokens = _prompt(112, 3, c.vocab_size)
    want, _ = _peer_prefill(peer, tokens)
    unscaled = dataclasses.replace(programs, dims=dataclasses.replace(programs.dims, rope_factor=1.0))
    assert _rel(Engine(unscaled, ref).forward(tokens).logits, want) > 100 * REL


def _peer_mtp(c: DeepSeekV4Config, weights: dict[str, torch.Tensor], base: Path) -> DeepseekV4ForCausalLM:
    """A one-layer peer holding the MTP block, its hc head and norm, and the shared embed/head."""
    k = c.num_hidden_layers
    tensors = {"embed.weight": weights["embed.weight"], "head.weight": weights["head.weight"]}
    for name, t in weights.items():
        if not name.startswith("mtp.0.") or name.removeprefix("mtp.0.") in MTP_LOCAL:
            continue
        rel = name.removeprefix("mtp.0.")
        top_level = rel == "norm.weight" or rel.startswith("hc_head_")
        tensors[rel if top_level else f"layers.0.{rel}"] = t
    return load_peer(base / "mtp", peer_config(c, kinds=[c.layer_kind(k)], hash_layers=0), tensors)


def _norm(weight: torch.Tensor):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm

    n = DeepseekV4RMSNorm(weight.shape[0], eps=M.NORM_EPS)
    n.weight.data.copy_(weight)
    return n


def test_mtp_matches_the_peer_building_blocks(setup):
    c, programs, ref, peer, weights, base = setup
    mtp = _peer_mtp(c, weights, base)
    tokens = _prompt(60, 5, c.vocab_size)
    last: list[torch.Tensor] = []
    hook = peer.model.layers[-1].register_forward_hook(lambda _m, _a, out: last.append(out[0]))
    with torch.no_grad():
        peer(tokens[None], use_cache=False)
    hook.remove()
    x, nxt = last[0][None, :-1], tokens[1:]  # stream at position i drafts with token i+1
    enorm, hnorm = _norm(weights["mtp.0.enorm.weight"]), _norm(weights["mtp.0.hnorm.weight"])
    with torch.no_grad():
        e = torch.nn.functional.linear(enorm(mtp.model.embed_tokens(nxt[None])), weights["mtp.0.e_proj.weight"])
        streams = e.unsqueeze(2) + torch.nn.functional.linear(hnorm(x), weights["mtp.0.h_proj.weight"])

    def feed(_module, args, kwargs):  # the MTP block's input is DeepSeek's, not an embedding
        if args:
            return (streams, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": streams}

    pre = mtp.model.layers[0].register_forward_pre_hook(feed, with_kwargs=True)
    try:
        with torch.no_grad():
            want = mtp(nxt[None], use_cache=False).logits[0]
    finally:
        pre.remove()
    engine = Engine(programs, ref)
    step = engine.forward(tokens)
    assert _rel(step.hidden, last[0]) <= REL  # the stream MTP consumes is the peer's
    got = engine.mtp(step.hidden[:-1], nxt, 0)
    assert _rel(got, want) <= REL
    assert torch.equal(got.argmax(-1), want.argmax(-1))
