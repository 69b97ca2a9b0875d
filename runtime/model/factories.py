"""The model's program functions, as factories over JSON captures (torch).

`runtime.programs.catalog` names these as "runtime.model.factories:<factory>" with the captures as
data, so the launch plan computes every key without importing this module; each program
closes over its captures only (checked when it is built), so they are all in its key.
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.model import forward as model
from runtime.model.dims import Dims
from runtime.model.ops import dense_calls


def layer(dims: dict, kind: str, ratio: int, hash_routed: bool, cache_names: list[str],
          weight_names: list[str], prefill: bool, experts_apart: bool = False, native_dense: bool = False) -> Callable:
    """With `experts_apart`, the program holds no routed expert: it returns the block's FFN parts
    (`model.FFN_PARTS`: the routed experts' input rows and choices among them) before the new
    cache rows, and the `experts` programs compute the routed sum (of every expert owner, with
    several ranks). `native_dense`: its FP8 and BF16 products are `dsv4::dense` calls (`ops.dense_calls`)."""
    def layer_program(x, tokens, positions, slots, starts, *rest):
        nc = len(cache_names)
        cache = dict(zip(cache_names, rest[:nc], strict=True))
        w = dict(zip(weight_names, rest[nc:], strict=True))
        rows = model.Rows(positions, slots, starts)
        with dense_calls(native_dense):
            out, new = model.block(Dims(**dims), kind, ratio, hash_routed, w, x, tokens, rows, cache, prefill,
                                   experts_apart)
        return (*(out if experts_apart else (out,)), *(new[n] for n in cache_names))

    return layer_program


def experts(dims: dict, weight_names: list[str], picked: bool | None = None, finish: bool = False,
            native: bool = False) -> Callable:
    """One rank's routed experts over rows of any layer (the experts' weights are inputs), from every
    rank with several: each row's share of its routed sum; `picked`: traced, only the picked (True)
    or only the dense (False) way (run eagerly on the cpu, it groups: `moe.routed`). `finish` (one
    rank): the program takes a layer program's FFN parts (`model.FFN_PARTS`) and returns the block's
    output, so the engine's layer call is two programs and no glue. `native` (`experts.native`): the
    compiled form is this function run eagerly, grouped, given the FP4 products built from C++
    (`fp4`: `runtime.model.native`), not a trace of it."""
    if finish:
        def finish_program(*args, fp4=None):
            parts, w = args[:model.FFN_PARTS], dict(zip(weight_names, args[model.FFN_PARTS:], strict=True))
            h, idx, weights = parts[model.ROUTED_INPUT]
            return model.ffn_out(parts, model.experts(Dims(**dims), w, h, idx, weights, None, picked, fp4))

        return finish_program

    def experts_program(h, idx, weights, expert_base, *tensors, fp4=None):
        w = dict(zip(weight_names, tensors, strict=True))
        return model.experts(Dims(**dims), w, h, idx, weights, expert_base, picked, fp4)

    return experts_program


def embed(dims: dict) -> Callable:
    def embed_program(tokens, embed_weight):
        return model.embed(Dims(**dims), {"embed.weight": embed_weight}, tokens)

    return embed_program


def head(dims: dict, weight_names: list[str], native_dense: bool = False) -> Callable:
    def head_program(x, *weights):
        with dense_calls(native_dense):
            return model.head(Dims(**dims), dict(zip(weight_names, weights, strict=True)), x)

    return head_program


def mtp_input(dims: dict, weight_names: list[str], native_dense: bool = False) -> Callable:
    def mtp_input_program(next_tokens, h, embed_weight, *weights):
        w = dict(zip(weight_names, weights, strict=True))
        with dense_calls(native_dense):
            return model.mtp_input(Dims(**dims), w, embed_weight[next_tokens], h)

    return mtp_input_program
