"""What a step must do (`bench.step_cost`), checked against the checkpoint's own tensor list: a
decode step's bytes are every packed layer byte once plus the experts its rows picked; a prefill's
FLOPs are two a weight a row of every matmul weight, the routed experts' over their own rows."""

from __future__ import annotations

import math

import pytest

from bench.step_cost import EXPERTS, HEAD, KV, LAYER, decode_bytes, kv_bytes, prefill_flops
from runtime.model.tensors import params_by_group
from runtime.programs.catalog import build_programs


@pytest.fixture(scope="module")
def tiny(tiny_packed):
    config, layout, weights = tiny_packed
    return config, layout, weights, build_programs(config, layout, max_seq=64)


def _stacked_bytes(layout, prefix: str, *, routed: bool) -> int:
    """Bytes of the layout's stacked tensors of the main layers (routed experts, or the rest)."""
    return sum(math.prod(t.shape) * {"U8": 1, "I8": 1, "F8_E4M3": 1, "BF16": 2, "F32": 4, "I32": 4}[t.dtype]
               for name, t in layout.tensors.items()
               if name.startswith(prefix) and ("ffn.experts." in name) == routed and "tid2eid" not in name)


def test_a_decode_step_reads_every_layer_weight_once_and_the_experts_its_rows_picked(tiny):
    config, layout, weights, programs = tiny
    layers = config.num_hidden_layers
    picked = [1 + i % config.n_routed_experts for i in range(layers)]
    one, three = (decode_bytes(programs, weights, [10] * n, picked) for n in (1, 3))
    experts_total = _stacked_bytes(layout, "layers.", routed=True)
    per_expert = experts_total // (layers * config.n_routed_experts)
    assert one.by_family[EXPERTS] == sum(picked) * per_expert
    hash_layers = sum(1 for i in range(layers) if config.is_hash_layer(i))
    entries = config.num_experts_per_tok * 4  # a row's int32 entries of the routing table (hash layers)
    assert one.by_family[LAYER] == _stacked_bytes(layout, "layers.", routed=False) + hash_layers * entries
    assert three.by_family[LAYER] - one.by_family[LAYER] == 2 * hash_layers * entries
    d, hc = config.hidden_size, config.hc_mult
    head = config.vocab_size * d * 2 + hc * d * hc * 4 + hc * 4 + 4 + d * 2  # BF16 head, F32 hc head, BF16 norm
    assert one.by_family[HEAD] == three.by_family[HEAD] == head  # read whole whatever the rows
    assert three.by_family[KV] == 3 * one.by_family[KV] > 0


def test_the_kv_rows_a_row_reads_grow_with_its_position_up_to_the_window(tiny):
    *_, programs = tiny
    d = programs.dims
    assert kv_bytes(d, "sliding", 0, 0) == 4 * d.head_dim
    assert kv_bytes(d, "sliding", 0, 10 * d.window) == kv_bytes(d, "sliding", 0, d.window) == 4 * d.window * d.head_dim


def test_a_prefill_multiplies_every_matmul_weight_of_the_checkpoint_once_a_row(tiny):
    config, _, weights, programs = tiny
    tokens, k, experts = 12, config.num_experts_per_tok, config.n_routed_experts
    rows = [[tokens * k // experts] * experts for _ in range(config.num_hidden_layers)]  # evenly routed
    cost = prefill_flops(programs, weights, tokens, rows)
    dense = routed = 0
    for group, params in params_by_group(config):
        if not group.startswith("layers."):
            continue
        for p in params:
            if p.init == "linear" or p.name.endswith("_fn"):  # the checkpoint's matmul weights
                if ".experts." in p.name:
                    routed += math.prod(p.shape)
                else:
                    dense += math.prod(p.shape)
    assert cost.by_family[LAYER] == 2 * tokens * dense
    assert cost.by_family[EXPERTS] == 2 * tokens * k * routed / experts  # each row through its k experts
    assert cost.by_family[HEAD] == 2 * (config.hidden_size * config.vocab_size + config.hidden_size * config.hc_mult
                                        * config.hc_mult)
    assert {shape for _, shape in cost.gemms} >= {(tokens, config.hidden_size, config.q_lora_rank)}
    assert cost.attention_flops > 0
