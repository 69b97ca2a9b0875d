"""The programs' form: the routed experts compiled once per model (`experts.picked`), every layer
program stopping before them, and the engine's calls putting them back together (more rows
grouped by expert, eagerly). Eager only: the programs' functions, never a compile."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.engine import Engine
from runtime.model.dims import Dims
from runtime.model.forward import FFN_PARTS
from runtime.model.moe import (
    _expert_tensors,
    _experts_dense,
    _experts_grouped,
    _experts_picked,
    picks_few,
)
from runtime.programs.calls import engine_runners
from runtime.programs.catalog import (
    EXPERTS_NATIVE,
    EXPERTS_PICKED,
    ROUTED_IN_LAYER,
    ROUTED_PREFIX,
    build_programs,
)
from runtime.programs.spec import build_function, program_key
from runtime.programs.tiers import COMPILED, EAGER, TieredRunners
from store.fingerprint import diff

MAX_SEQ = 64


def _units(programs):
    return {name: build_function(spec) for name, spec in programs.specs.items()}


def _rows_recorded(run, rows: list[int]):
    """`run`, recording each call's rows (its first input's first dim) in `rows`."""
    def call(*args):
        rows.append(args[0].shape[0])
        return run(*args)
    return call


def _routed_inputs(spec) -> list[str]:
    return [t.name for t in spec.inputs if t.name.startswith("w." + ROUTED_PREFIX)]


def test_layer_programs_hold_no_routed_expert_and_one_experts_program_serves_every_layer(tiny_packed):
    config, layout, _ = tiny_packed
    apart = build_programs(config, layout, MAX_SEQ)
    layers = [s for n, s in apart.specs.items() if n.startswith("layer.")]
    assert layers and all(not _routed_inputs(s) for s in layers)
    assert [n for n in apart.specs if n.startswith("experts")] == [EXPERTS_PICKED, EXPERTS_NATIVE]
    assert _routed_inputs(apart.specs[EXPERTS_PICKED]) == [f"w.{n}" for n in apart.weight_names["experts"]]
    # the grouped way with native FP4 products: the same inputs, built from C++ rather than traced
    picked, native = apart.specs[EXPERTS_PICKED], apart.specs[EXPERTS_NATIVE]
    assert native.inputs == picked.inputs and native.fn == picked.fn
    assert native.captures["native"] is True and "picked" not in native.captures
    inside = build_programs(config, layout, MAX_SEQ, routed=ROUTED_IN_LAYER)
    assert all(_routed_inputs(s) for n, s in inside.specs.items() if n.startswith("layer."))
    assert not any(n.startswith("experts") for n in inside.specs)


def test_a_host_with_no_cxx_compiler_has_no_experts_native_and_groups_with_the_eager_decode(tiny_packed, monkeypatch):
    """`experts.native` is built from C++ source: where no compiler is found, the catalog holds no such
    program (rather than one that cannot compile and would end the launch), and the engine's
    grouped way decodes eagerly, to the same numbers."""
    config, layout, weights = tiny_packed
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "")
    programs = build_programs(config, layout, MAX_SEQ)
    assert EXPERTS_NATIVE not in programs.specs and EXPERTS_PICKED in programs.specs
    monkeypatch.undo()
    with_native = build_programs(config, layout, MAX_SEQ)
    assert EXPERTS_NATIVE in with_native.specs
    assert set(with_native.specs) - set(programs.specs) == {EXPERTS_NATIVE}
    prompt = torch.arange(3, 30)
    want = Engine(with_native, weights).forward(prompt).logits
    assert torch.equal(Engine(programs, weights, engine_runners(programs, _units(programs))).forward(prompt).logits,
                       want)


def test_a_layer_programs_key_changes_with_the_form(tiny_packed):
    """An entry compiled in the other form never loads for this one: its signature, captures and
    the source of what the layer program runs are in its key."""
    config, layout, _ = tiny_packed
    apart = build_programs(config, layout, MAX_SEQ)
    inside = build_programs(config, layout, MAX_SEQ, routed=ROUTED_IN_LAYER)
    name = next(n for n in apart.specs if n.startswith("layer."))
    a, b = program_key(apart.specs[name], "export"), program_key(inside.specs[name], "export")
    assert a != b and {"signature", "captures"} <= {c.component for c in diff(a, b)}
    assert {"source:runtime.model.factories.layer", "source:runtime.model.moe.routed"} <= set(a.as_dict())


def test_the_experts_programs_take_what_the_layer_programs_give(tiny_packed):
    config, layout, _ = tiny_packed
    programs = build_programs(config, layout, MAX_SEQ)
    picked = programs.specs[EXPERTS_PICKED]
    for name, spec in programs.specs.items():
        if not name.startswith("layer."):
            continue
        rows = 3
        sizes = {d.name: (rows if d.name in ("T", "B") else 2) for d in spec.dims}
        inputs = [torch.empty([sizes.get(s, s) for s in t.shape], dtype=getattr(torch, t.dtype), device="meta")
                  for t in spec.inputs]
        parts = build_function(spec)(*inputs)[:FFN_PARTS]
        for got, want in zip(parts, picked.inputs[:FFN_PARTS], strict=True):
            assert (str(got.dtype).removeprefix("torch."), tuple(got.shape)) == \
                (want.dtype, tuple(rows if s == "M" else s for s in want.shape)), (name, want.name)


def test_the_engines_calls_over_the_programs_compute_the_fused_blocks_model(tiny_packed):
    """A prefill, a decode step of one row and one of four sequences, and an MTP draft: the layer
    program then the routed experts give the very numbers of the whole block run eagerly (and so
    do the baseline form's programs)."""
    config, layout, weights = tiny_packed
    programs = build_programs(config, layout, MAX_SEQ)
    calls = Engine(programs, weights, engine_runners(programs, _units(programs)), slots=4)
    whole = Engine(programs, weights, slots=4)
    prompt = torch.arange(3, 30)
    want = whole.forward(prompt).logits
    assert torch.equal(calls.forward(prompt).logits, want)
    inside = build_programs(config, layout, MAX_SEQ, routed=ROUTED_IN_LAYER)
    assert torch.equal(Engine(inside, weights, engine_runners(inside, _units(inside))).forward(prompt).logits, want)
    one = [(0, torch.tensor([7]))]
    assert torch.equal(calls.step(one).logits, whole.step(one).logits)
    for engine in (calls, whole):
        for slot in (1, 2, 3):
            engine.forward(torch.tensor([slot, 40 + slot]), slot)
    four = [(slot, torch.tensor([9 + slot])) for slot in range(4)]
    a, b = calls.step(four), whole.step(four)
    assert torch.equal(a.logits, b.logits)
    drafts = [(0, 29, a.hidden[:1], [5])]
    assert torch.equal(calls.mtp_step(drafts), whole.mtp_step(drafts))


def test_an_experts_program_swapped_in_runs_from_the_next_step_in_every_layer(tiny_packed):
    config, layout, weights = tiny_packed
    programs = build_programs(config, layout, MAX_SEQ)
    units = _units(programs)
    table = TieredRunners(units, dict.fromkeys(units, EAGER))
    engine = Engine(programs, weights, engine_runners(programs, table, fuses=True))
    reference = Engine(programs, weights)
    ran: list[int] = []

    def compiled_picked(*args):  # stands for the compiled program: the same numbers
        ran.append(engine.calls)
        return units[EXPERTS_PICKED](*args)

    engine.forward(torch.arange(3, 12))
    reference.forward(torch.arange(3, 12))
    table.stage(EXPERTS_PICKED, compiled_picked)
    assert ran == []  # staged, not yet in: a swap lands between two steps
    step = [(0, torch.tensor([7]))]
    assert torch.equal(engine.step(step).logits, reference.step(step).logits)
    layers = sum(g.startswith("layers.") for g in programs.variants)
    assert ran == [engine.calls] * layers and table.tiers[EXPERTS_PICKED] == COMPILED


@pytest.mark.slow
def test_a_fused_compiled_picked_program_serves_few_rows_and_the_rest_run_grouped_eagerly(tiny_packed):
    """The compiled `experts.picked` runs only where it beats grouping: fused (aoti), once
    compiled, for rows picking fewer pairs per expert than `moe.picks_few`'s limit (tiny's small
    experts: about 32), and only until `experts.native` is compiled. Op by op (export), on the
    eager tier, or for more rows, the same function runs eagerly, grouped by expert; once
    `experts.native` is compiled, it runs every layer's rows. Either way the step's numbers are the
    eager block's."""
    config, layout, weights = tiny_packed
    programs = build_programs(config, layout, MAX_SEQ)
    units = _units(programs)
    ran: list[int] = []
    compiled_picked = _rows_recorded(units[EXPERTS_PICKED], ran)  # stands for the compiled program
    native_ran: list[int] = []
    compiled_native = _rows_recorded(units[EXPERTS_NATIVE], native_ran)  # stands for the compiled `experts.native`

    def step(engine, rows: int):  # four sequences of two tokens, then `rows` more each (packed)
        for slot in range(4):
            engine.forward(torch.tensor([slot + 1, slot + 2]), slot)
        ran.clear()
        native_ran.clear()
        return engine.step([(slot, torch.arange(9, 9 + rows) + slot) for slot in range(4)], prefill=False).logits

    def experts_run(fuses: bool, picked_tier: str, rows: int, native_tier: str = EAGER) -> list[int]:
        table = TieredRunners({**units, EXPERTS_PICKED: compiled_picked, EXPERTS_NATIVE: compiled_native},
                              {**dict.fromkeys(units, COMPILED), EXPERTS_PICKED: picked_tier,
                               EXPERTS_NATIVE: native_tier})
        logits = step(Engine(programs, weights, engine_runners(programs, table, fuses), slots=4), rows)
        assert torch.equal(logits, reference[rows])
        return sorted(set(ran))

    reference = {rows: step(Engine(programs, weights, slots=4), rows) for rows in (1, 40)}
    k, n, size = config.num_experts_per_tok, config.n_routed_experts, \
        3 * config.hidden_size * config.moe_intermediate_size
    assert not picks_few(4, k, n)  # op by op: 4 rows pick as many pairs as tiny has experts
    assert picks_few(4 * 30, k, n, True, size) and not picks_few(4 * 40, k, n, True, size)
    assert experts_run(fuses=True, picked_tier=COMPILED, rows=1) == [4]  # picked, in every layer
    assert experts_run(fuses=True, picked_tier=COMPILED, rows=40) == []  # 40 pairs per expert: grouped
    assert experts_run(fuses=False, picked_tier=COMPILED, rows=1) == []
    assert experts_run(fuses=True, picked_tier=EAGER, rows=1) == []
    # once `experts.native` is compiled (natively, whatever the backend), it serves every row count
    # on the cpu: each layer's rows, once
    assert native_ran == []
    layers = sum(g.startswith("layers.") for g in programs.variants)
    for fuses in (True, False):
        for rows in (1, 40):
            assert experts_run(fuses=fuses, picked_tier=COMPILED, rows=rows, native_tier=COMPILED) == []
            assert native_ran == [4 * rows] * layers


def test_grouping_by_expert_computes_the_dense_and_the_picked_ways_numbers(tiny_packed):
    """The grouped way (eager: each expert over its rows) against both traced ways, run eagerly
    by hand: the same sums, of every expert or of one rank's share (other ranks' choices
    skipped, as the dense way weighs them 0)."""
    config, _, weights = tiny_packed
    d = Dims.of(config, MAX_SEQ)
    experts = _expert_tensors(weights["layers.2"])
    n, k = config.n_routed_experts, config.num_experts_per_tok
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 3, 40):
        h = torch.randn(rows, config.hidden_size, generator=gen)
        idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(rows)])
        gates = torch.rand(rows, k, generator=gen)
        got = _experts_grouped(d, experts, h, idx, gates)
        torch.testing.assert_close(got, _experts_dense(d, experts, h, idx, gates), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got, _experts_picked(d, experts, h, idx, gates), rtol=1e-5, atol=1e-5)
        half = {name: t[n // 2:] for name, t in experts.items()}  # the second rank's experts
        mine = (idx >= n // 2)
        share = _experts_grouped(d, half, h, idx - n // 2, gates)
        want = _experts_dense(d, half, h, (idx - n // 2).clamp(0, n // 2 - 1), torch.where(mine, gates, 0.0))
        torch.testing.assert_close(share, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(_experts_grouped(d, experts, h[:0], idx[:0], gates[:0]), h[:0])


def test_a_step_asked_for_its_last_rows_logits_runs_the_head_on_those_rows_only(tiny_packed):
    """`logits_rows`: the head (a vocabulary-wide matmul) runs on the rows whose logits are
    wanted, and they are the rows of a step that computed every row's (to a matmul's rounding
    over fewer rows); the hidden streams (the MTP layer's input) keep every row."""
    config, layout, weights = tiny_packed
    programs = build_programs(config, layout, MAX_SEQ)
    units = _units(programs)
    heads: list[int] = []
    head = _rows_recorded(units["head.decode"], heads)
    engines = [Engine(programs, weights, engine_runners(programs, {**units, "head.decode": head}), slots=3)
               for _ in range(2)]
    batch = [(0, torch.arange(3, 10)), (1, torch.tensor([5])), (2, torch.arange(20, 24))]
    every = engines[0].step(batch, prefill=False)
    some = engines[1].step(batch, prefill=False, logits_rows=[1, 1, 2])
    assert heads == [12, 4]
    torch.testing.assert_close(some.logits, every.logits[[6, 7, 10, 11]], rtol=1e-5, atol=1e-5)
    assert torch.equal(some.hidden, every.hidden)
    drafts = [(0, 0, every.hidden[:7], list(range(4, 11))), (2, 0, every.hidden[8:], [21, 22, 23, 24])]
    torch.testing.assert_close(engines[1].mtp_step(drafts, logits_rows=[1, 1]),
                               engines[0].mtp_step(drafts)[[6, 10]], rtol=1e-5, atol=1e-5)
    for wrong in ([1, 1], [0, 1, 1], [1, 2, 1]):
        with pytest.raises(ValueError, match="logits"):
            engines[1].step(batch, prefill=False, logits_rows=wrong)
