"""No compile after ready (`runtime.programs.after_ready`): what a ready service compiles, loads or
specialises is counted by program and kind, logged (warn) or refused (error); a tier swap is
counted and named, never refused."""

from __future__ import annotations

import pytest
import sample_programs
import torch

from runtime.programs.after_ready import (
    JIT,
    LOAD,
    OUTSIDE,
    TIER_SWAP,
    AfterReady,
    CompileAfterReady,
    arm,
    for_tier_swap,
)
from runtime.programs.tiers import COMPILED, EAGER, TieredRunners


def _branches(x: torch.Tensor) -> torch.Tensor:
    """An eager `torch.cond`: torch compiles its branches (dynamo) at their first call."""
    return torch.cond(x.sum() > 0, lambda x: x + 1, lambda x: x - 1, (x,))


def _refused_branches(x: torch.Tensor) -> torch.Tensor:  # branches of their own: compiled afresh
    return torch.cond(x.sum() > 0, lambda x: x + 1, lambda x: x - 1, (x,))


def _outside_branches(x: torch.Tensor) -> torch.Tensor:
    return torch.cond(x.sum() > 0, lambda x: x + 2, lambda x: x - 2, (x,))


def _plain(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def _table(mode: str, lines: list, head=_branches) -> tuple[TieredRunners, AfterReady]:
    table = TieredRunners({"layer.decode": _plain, "head.decode": head}, {"layer.decode": COMPILED,
                                                                           "head.decode": EAGER})
    watch = arm(table, mode, lambda message, **detail: lines.append((message, detail)))
    return table, watch


def test_a_program_call_that_compiles_after_ready_is_counted_by_program_and_said():
    lines: list = []
    table, watch = _table("warn", lines)
    try:
        table["layer.decode"](torch.ones(3))
        assert watch.counts == {}  # plain ops compile nothing
        out = table["head.decode"](torch.ones(5))
        assert torch.equal(out, torch.full((5,), 2.0))  # warn: the call's result stands
        assert watch.counts[("head.decode", JIT)] >= 1 and set(watch.counts) == {("head.decode", JIT)}
        message, detail = lines[-1]
        assert message.startswith("warning: head.decode: torch compiled a graph") and detail["kind"] == JIT
        table["head.decode"](torch.ones(5))  # the same shape again: torch reuses its graph
        assert watch.total == watch.counts[("head.decode", JIT)]
    finally:
        watch.disarm()


def test_error_refuses_a_compile_after_ready_and_still_counts_it():
    lines: list = []
    table, watch = _table("error", lines, _refused_branches)
    try:
        with pytest.raises(CompileAfterReady, match=r"head\.decode: .*refused.*--compile-after-ready error"):
            table["head.decode"](torch.ones(7))
        assert watch.counts[("head.decode", JIT)] >= 1
        assert lines[-1][1]["refused"] is True
    finally:
        watch.disarm()


def test_a_compile_between_program_calls_is_put_outside_them():
    table, watch = _table("warn", [])
    try:
        _outside_branches(torch.ones(11))  # no program's call: the engine's own ops, say
        table["layer.decode"](torch.ones(3))
        assert ("layer.decode", JIT) not in watch.counts and watch.counts[(OUTSIDE, JIT)] >= 1
    finally:
        watch.disarm()


def test_before_ready_nothing_counts():
    table = TieredRunners({"head.decode": _branches}, {"head.decode": EAGER})
    watch = AfterReady("error")
    table.watch = watch  # on the table, but the service is not ready yet (validate runs here)
    table["head.decode"](torch.ones(13))
    assert watch.counts == {}


def test_a_tier_swap_is_counted_and_named_never_refused():
    lines: list = []
    table, watch = _table("error", lines)
    try:
        table.stage("head.decode", _plain)
        assert table.swap_point() == ["head.decode"]
        assert table.tiers["head.decode"] == COMPILED
        assert watch.counts == {("head.decode", TIER_SWAP): 1}
        assert lines[-1][0] == "head.decode: compiled tier swapped in (--ready early) after ready"
        assert torch.equal(table["head.decode"](torch.ones(2)), torch.full((2,), 2.0))
    finally:
        watch.disarm()


def test_a_program_loaded_after_ready_counts_unless_a_tier_swap_loads_it():
    from runtime.programs.build import prepare

    watch = arm({}, "warn", lambda message, **detail: None)  # an eager launch's table: no watch slot
    try:
        with for_tier_swap():
            prepare(sample_programs.spec("swapped"), cache=None, backend="export")
        assert watch.counts == {}
        prepared = prepare(sample_programs.spec("late"), cache=None, backend="export")
        assert watch.counts[("late", LOAD)] == 1 and watch.counts[("late", "compile")] == 1
        assert prepared.run(*sample_programs.inputs()) is not None
    finally:
        watch.disarm()
    prepare(sample_programs.spec("after"), cache=None, backend="export")
    assert ("after", LOAD) not in watch.counts  # disarmed with its launch's close


def test_listeners_hear_the_counts_so_far_and_each_new_one():
    table, watch = _table("warn", [])
    try:
        table.stage("layer.decode", _plain)
        table.swap_point()
        heard: list = []
        watch.listen(lambda program, kind, n: heard.append((program, kind, n)))
        table.stage("head.decode", _plain)
        table.swap_point()
        assert heard == [("layer.decode", TIER_SWAP, 1), ("head.decode", TIER_SWAP, 1)]
    finally:
        watch.disarm()


def test_an_unknown_mode_is_one_line():
    with pytest.raises(ValueError, match="one of warn, error"):
        AfterReady("strict")
