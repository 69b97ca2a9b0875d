"""What the engine calls by name, over the programs that compile.

The catalog's programs (what compiles, what the kernel cache holds, what the plan lists) and the
engine's calls differ in one place: the routed experts. In the `ROUTED_APART` form every layer
program stops before them and returns the block's FFN parts; `experts.picked` and `experts.dense`
serve every layer. With one rank, a call of a layer runs its layer program, then the one of the two
its rows need (`moe.picks_few`, the rule an eager step follows, for the form `experts.picked` runs
in), which finishes the block: the engine's calls are those of the form before, and no op runs
between the programs. Several ranks exchange the rows between the two themselves: the engine calls
`experts` on the rows it received, which runs the one of the two they need.

Programs are looked up in the table at every call, so a program swapped in between two steps
(`TieredRunners`) is what the next step runs, whichever part of a call it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from runtime.programs.catalog import (
    EXPERTS_DENSE,
    EXPERTS_PICKED,
    EXPERTS_PROGRAM,
    ROUTED_APART,
    ModelPrograms,
)
from runtime.programs.tiers import COMPILED

Runner = Callable[..., Any]


def engine_runners(programs: ModelPrograms, table: Mapping[str, Runner], fuses: bool = False) -> Mapping[str, Runner]:
    """The runners the engine calls, by name, over `table` (program name → runner, any tier).
    `fuses`: the table's compiled programs are fused kernels (aoti), not graphs run op by op
    (export), so `experts.picked` serves more rows once compiled (`moe.picks_few`)."""
    if programs.routed != ROUTED_APART:
        return table  # each layer program computes its routed experts: the engine calls the programs
    return EngineRunners(programs, table, fuses)


class EngineRunners(Mapping):
    """`experts` (several ranks) or each layer (one rank), composed of the programs in `table`;
    every other name is the table's own runner. Runs for every layer of every step: a few lookups."""

    def __init__(self, programs: ModelPrograms, table: Mapping[str, Runner], fuses: bool = False):
        from runtime.model.moe import picks_few

        self.table = table
        self._fuses = fuses
        self._picks_few = picks_few
        self._calls: dict[str, Runner] = {}
        if programs.expert_parallel:
            self._calls[EXPERTS_PROGRAM] = self._experts
        else:
            for name, spec in programs.specs.items():
                if name.startswith("layer."):  # a call passes the program's inputs, then the experts'
                    self._calls[name] = self._layer(name, len(spec.inputs))

    def __getitem__(self, name: str) -> Runner:
        call = self._calls.get(name)
        return call if call is not None else self.table[name]

    def __iter__(self) -> Iterator[str]:
        return iter({**dict.fromkeys(self.table), **dict.fromkeys(self._calls)})

    def __len__(self) -> int:
        return len(set(self.table) | set(self._calls))

    def swap_point(self) -> None:
        """Between two steps: the table's staged programs swap in (`TieredRunners.swap_point`)."""
        swap = getattr(self.table, "swap_point", None)
        if swap is not None:
            swap()

    def _experts_program(self, rows: int, topk: int, experts: int) -> str:
        """The experts program these rows need: the rule an eager step follows, for the form
        `experts.picked` runs in now (fused once compiled by a fusing backend, op by op on the
        eager tier)."""
        tiers = getattr(self.table, "tiers", None)
        fused = self._fuses and (tiers is None or tiers.get(EXPERTS_PICKED) == COMPILED)
        return EXPERTS_PICKED if self._picks_few(rows, topk, experts, fused) else EXPERTS_DENSE

    def _experts(self, h, idx, weights, expert_base, *tensors):
        """Several ranks: this rank's share of the rows it received (any rank's)."""
        program = self._experts_program(h.shape[0], idx.shape[1], tensors[0].shape[0])  # experts held: the first dim
        return self.table[program](h, idx, weights, expert_base, *tensors)

    def _layer(self, name: str, inputs: int) -> Runner:
        """One rank: the layer program, then the experts program its rows need, which finishes the block."""
        from runtime.model.forward import FFN_PARTS, ROUTED_INPUT

        h_at = ROUTED_INPUT.start  # the parts (…, h, idx, weights, …): the experts' rows and choices
        table, experts_program = self.table, self._experts_program

        def call(*args):
            out = table[name](*args[:inputs])
            program = experts_program(out[h_at].shape[0], out[h_at + 1].shape[1], args[inputs].shape[0])
            x = table[program](*out[:FFN_PARTS], *args[inputs:])
            return (x if not isinstance(x, list | tuple) else x[0], *out[FFN_PARTS:])

        return call
