"""Getting the packed weights: one small interface, two implementations, chosen by the plan.

`MapSidecar` maps a valid sidecar (zero-copy views through one fd); `RepackCheckpoint` packs the
checkpoint in memory, one layer at a time. The launch plan's sidecar verdict picks one; if the
sidecar changed between the plan and the open (its own verdict is taken again through the fd it
maps), mapping falls back to repacking and says why — never maps bytes it did not judge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from store.sidecar import MAP, REPACK

Progress = Callable[[int, int, str], None]  # (groups done, groups total, group name)
Log = Callable[[str], None]


@dataclass
class LoadedWeights:
    tensors: dict[str, Any]  # packed name → host tensor (views of the mapping, or packed arrays)
    detail: dict[str, Any]  # path (MAP | REPACK), reason, detail, residency
    close: Callable[[], None] = field(default=lambda: None)
    mapped: Any = None  # the MappedSidecar on MAP: its lease/watch says when the file changes


class WeightLoader(Protocol):
    path: str

    def load(self, progress: Progress, log: Log) -> LoadedWeights: ...


@dataclass
class RepackCheckpoint:
    ckpt: Any
    packed: Any  # runtime.weights.layout.PackedLayout
    reason: str
    detail: str
    rank: int | None = None  # one rank of several: pack its routed experts only
    path: str = REPACK

    def load(self, progress: Progress, log: Log) -> LoadedWeights:
        from runtime.weights.pack import pack_in_memory

        tensors = pack_in_memory(self.ckpt, self.packed, progress, self.rank)
        return LoadedWeights(tensors, {"path": REPACK, "reason": self.reason, "detail": self.detail})


@dataclass
class MapSidecar:
    model_dir: Any
    ranks: int
    packed: Any  # runtime.weights.layout.PackedLayout
    cold_policy: str
    ckpt: Any
    rank: int | None = None  # one rank of several: views of the shared tensors and its experts only
    config: bytes | None = None  # config.json as the plan read it
    path: str = MAP

    def load(self, progress: Progress, log: Log) -> LoadedWeights:
        from runtime.weights.pack import rank_slice
        from runtime.weights.prepack import open_prepacked

        verdict, mapped = open_prepacked(self.model_dir, self.ranks, cold_policy=self.cold_policy,
                                         packed=self.packed, config=self.config)
        log(verdict.line())
        if mapped is None:  # changed since the plan was made: repack, saying why
            return RepackCheckpoint(self.ckpt, self.packed, verdict.reason, verdict.detail,
                                    self.rank).load(progress, log)
        tensors = dict(mapped.tensors)
        if self.rank is not None:
            tensors = rank_slice(self.packed, tensors, self.rank)
        return LoadedWeights(tensors, {"path": MAP, "reason": "", "detail": verdict.detail,
                                       "residency": verdict.residency}, mapped.close, mapped)


def loader_for(plan, ckpt, rank: int = 0) -> WeightLoader:
    """The loader the plan's sidecar verdict calls for (one rank's share when ranks > 1)."""
    sidecar, spec = plan.sidecar, plan.spec
    share = rank if spec.ranks > 1 else None
    if sidecar is not None and sidecar.mapped:
        return MapSidecar(spec.model, spec.ranks, plan.layout, spec.cold_policy, ckpt, share, plan.config_bytes)
    return RepackCheckpoint(ckpt, plan.layout, sidecar.reason if sidecar else "", sidecar.detail if sidecar else "",
                            share)
