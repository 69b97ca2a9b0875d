"""Per-layer weight dicts for the model's block functions: packed view and reference view.

Both are "get packed layer weights" for the programs; they differ only in where the numbers
come from. `packed_views` slices the packed layout (a mapped sidecar or in-memory packing:
zero-copy views except where experts of several ranks are joined). `reference_views`
dequantises the checkpoint to float: the independent path tests compare against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from runtime.model.tensors import Param
from runtime.weights.pack import EXPERTS, I32, KEEP, QUANT, PackedLayout, T, dequantize
from store.checkpoint import Checkpoint

TOP = "top"


@dataclass
class ModelWeights:
    """Weight dicts by group: 'top', 'layers.0', …, 'mtp.0'."""

    groups: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def __getitem__(self, group: str) -> dict[str, torch.Tensor]:
        return self.groups[group]

    def nbytes(self) -> int:
        seen, total = set(), 0
        for w in self.groups.values():
            for t in w.values():
                key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.nbytes)
                if key not in seen:
                    seen.add(key)
                    total += t.nbytes
        return total


def packed_views(packed: PackedLayout, tensors: dict[str, torch.Tensor]) -> ModelWeights:
    out = ModelWeights()
    for group, params in packed.groups:
        w: dict[str, torch.Tensor] = {}
        for p in params:
            slot = packed.slots[p.name]
            for name in slot.names:
                key = slot.relative(name)
                if key in w:
                    continue  # experts: the whole layer was taken at the first expert
                if slot.rule.group == EXPERTS:
                    layer = tensors[name][:, slot.index[1]]  # [ranks, E/r, …]
                    w[key] = layer.reshape(-1, *layer.shape[2:])
                else:
                    w[key] = tensors[name][slot.index] if slot.index else tensors[name]
        out.groups[group] = w
    return out


def _reference_tensor(ckpt: Checkpoint, packed: PackedLayout, p: Param) -> tuple[str, torch.Tensor]:
    slot = packed.slots[p.name]
    rule = slot.rule
    if rule.transform == QUANT:
        key = slot.relative(slot.names[0]).removesuffix(".qweight") + ".weight"
        return key, dequantize(ckpt, packed.config, p).t()
    key = slot.relative(slot.names[0])
    raw = ckpt.read(p.name)
    if rule.transform == T:
        return key, raw.float().t()
    if rule.transform == I32:
        return key, raw.long()
    assert rule.transform == KEEP
    return key, raw.float()


def reference_views(ckpt: Checkpoint, packed: PackedLayout) -> ModelWeights:
    """Float weights straight from the checkpoint (FP8/FP4 dequantised with their block scales):
    no stacking, no packed layout. The packed path keeps the same numbers, so it must match
    this view to float rounding; any layout or packing bug shows as a difference."""
    out = ModelWeights()
    for group, params in packed.groups:
        w: dict[str, torch.Tensor] = {}
        experts: dict[str, list[torch.Tensor]] = {}
        for p in params:
            key, value = _reference_tensor(ckpt, packed, p)
            if packed.slots[p.name].rule.group == EXPERTS:
                experts.setdefault(key, []).append(value)  # params come in expert order
            else:
                w[key] = value
        for key, values in experts.items():
            w[key] = torch.stack(values)
        out.groups[group] = w
    return out
