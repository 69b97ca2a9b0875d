"""What the engine calls by name, over the programs that compile.

The catalog's programs (what compiles, what the kernel cache holds, what the plan lists) and the
engine's calls differ in one place: the routed experts. In the `ROUTED_APART` form every layer
program stops before them and returns the block's FFN parts; `experts.picked` serves every layer.
With one rank, a call of a layer runs its layer program, then the routed experts, which finish the
block. On the cpu, once `experts.native` is compiled, it runs them: the experts' function run
eagerly, grouping the rows by expert (`moe._experts_grouped`: each used expert once, over only its
rows), with FP4 products compiled natively (`runtime.model.native`: each byte decoded in
registers into its rows' sums, every expert's in one call a weight): faster than every other way
at every row count measured (a lone 32-token prefill of `small`, the whole step: 124 ms, against
162-166 ms with one native call an expert and weight, 225 ms with inductor's decode, 487 ms
picked). Before that (and on an accelerator), the compiled `experts.picked` when its rows pick few enough (row,
expert) pairs for it (`moe.picks_few`, fused: it decodes each pick where it multiplies), otherwise
the same function run eagerly, grouped with the eager decode (a static program cannot hold shapes
that depend on the routing, and its dense form computes every expert on every row: 3.4× slower at
256 rows of `small`). Op by op (export, the eager tier) the grouped way is never slower than the
picked one. (On an accelerator the eager function runs the static ways instead: grouping reads
counts back to the host, `moe.routed`.) Several ranks exchange the rows themselves: the engine calls
`experts` on the rows it received, which runs the way they need.

Programs are looked up in the table at every call, so a program swapped in between two steps
(`TieredRunners`) is what the next step runs, whichever part of a call it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from runtime.programs.catalog import (
    EXPERTS_NATIVE,
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
    (export): only then does the compiled `experts.picked` beat the grouped way (`moe.picks_few`)."""
    if programs.routed != ROUTED_APART:
        return table  # each layer program computes its routed experts: the engine calls the programs
    return EngineRunners(programs, table, fuses)


class EngineRunners(Mapping):
    """`experts` (several ranks) or each layer (one rank), composed of the programs in `table`;
    every other name is the table's own runner. Runs for every layer of every step: a few lookups."""

    def __init__(self, programs: ModelPrograms, table: Mapping[str, Runner], fuses: bool = False):
        from runtime.model.moe import picks_few, weights_per_expert
        from runtime.programs.spec import build_function

        self.table = table
        self._fuses = fuses
        self._picks_few = picks_few
        picked = programs.specs[EXPERTS_PICKED]
        self._expert_weights = weights_per_expert({t.name: (tuple(t.shape), t.dtype) for t in picked.inputs
                                                   if t.name.startswith("w.")})
        # the experts' function run eagerly: grouped by expert (what runs more rows than the compiled
        # picked program suits, and every step op by op)
        self.grouped = build_function(picked)
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

    def _experts_runner(self, rows: int, topk: int, experts: int, cpu: bool) -> Runner:
        """What runs these rows' routed experts. On the cpu, once `experts.native` is compiled: it
        (the grouped way, its FP4 products native: faster than the compiled `experts.picked` from
        one row up). Else the compiled `experts.picked` when it is fused (aoti) and the rows pick
        few (`moe.picks_few`); else the grouped way, eagerly."""
        if cpu and EXPERTS_NATIVE in self.table and self._compiled(EXPERTS_NATIVE):
            return self.table[EXPERTS_NATIVE]
        if self._fuses and self._compiled(EXPERTS_PICKED) and self._picks_few(rows, topk, experts, True,
                                                                              self._expert_weights):
            return self.table[EXPERTS_PICKED]
        return self.grouped

    def _compiled(self, name: str) -> bool:
        """Is `name` compiled now, not the eager tier standing in for it?"""
        tiers = getattr(self.table, "tiers", None)
        return tiers is None or tiers.get(name) == COMPILED

    def _experts(self, h, idx, weights, expert_base, *tensors):
        """Several ranks: this rank's share of the rows it received (any rank's)."""
        # experts held: tensors[0]'s first dim
        run = self._experts_runner(h.shape[0], idx.shape[1], tensors[0].shape[0], h.is_cpu)
        return run(h, idx, weights, expert_base, *tensors)

    def _layer(self, name: str, inputs: int) -> Runner:
        """One rank: the layer program, then the routed experts its rows need, which finish the block."""
        from runtime.model.forward import FFN_PARTS, ROUTED_INPUT

        h_at = ROUTED_INPUT.start  # the parts (…, h, idx, weights, …): the experts' rows and choices
        table, experts_runner = self.table, self._experts_runner

        def call(*args):
            out = table[name](*args[:inputs])
            h = out[h_at]
            run = experts_runner(h.shape[0], out[h_at + 1].shape[1], args[inputs].shape[0], h.is_cpu)
            x = run(*out[:FFN_PARTS], *args[inputs:])
            return (x if not isinstance(x, list | tuple) else x[0], *out[FFN_PARTS:])

        return call
