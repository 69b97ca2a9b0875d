"""The model's program functions, as factories over JSON captures (torch).

`runtime.programs.catalog` names these as "runtime.model.factories:<factory>" with the captures as
data, so the launch plan computes every key without importing this module; each program
closes over its captures only (checked when it is built), so they are all in its key.
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.model import forward as model
from runtime.model.dims import Dims


def layer(dims: dict, kind: str, ratio: int, hash_routed: bool, cache_names: list[str],
          weight_names: list[str], prefill: bool, expert_parallel: bool = False) -> Callable:
    """Expert parallel, the program holds no routed expert: it returns the block's FFN parts
    (`model.FFN_PARTS`: the routed experts' input rows and choices among them) before the new
    cache rows, and the `experts` program of each owner computes their shares."""
    def layer_program(x, tokens, positions, slots, starts, *rest):
        nc = len(cache_names)
        cache = dict(zip(cache_names, rest[:nc], strict=True))
        w = dict(zip(weight_names, rest[nc:], strict=True))
        rows = model.Rows(positions, slots, starts)
        out, new = model.block(Dims(**dims), kind, ratio, hash_routed, w, x, tokens, rows, cache, prefill,
                               expert_parallel)
        return (*(out if expert_parallel else (out,)), *(new[n] for n in cache_names))

    return layer_program


def experts(dims: dict, weight_names: list[str]) -> Callable:
    """One rank's routed experts over rows dispatched to it by every rank (any layer: the
    experts' weights are inputs)."""
    def experts_program(h, idx, weights, expert_base, *tensors):
        w = dict(zip(weight_names, tensors, strict=True))
        return model.experts(Dims(**dims), w, h, idx, weights, expert_base)

    return experts_program


def embed(dims: dict) -> Callable:
    def embed_program(tokens, embed_weight):
        return model.embed(Dims(**dims), {"embed.weight": embed_weight}, tokens)

    return embed_program


def head(dims: dict, weight_names: list[str]) -> Callable:
    def head_program(x, *weights):
        return model.head(Dims(**dims), dict(zip(weight_names, weights, strict=True)), x)

    return head_program


def mtp_input(dims: dict, weight_names: list[str]) -> Callable:
    def mtp_input_program(next_tokens, h, embed_weight, *weights):
        w = dict(zip(weight_names, weights, strict=True))
        return model.mtp_input(Dims(**dims), w, embed_weight[next_tokens], h)

    return mtp_input_program
