"""Packing: checkpoint tensors → the serving layout the programs consume (and sidecars hold).

`RULES` is the one table of packing: one row per tensor family, naming the transform and the
group the family is stacked in. It is also the sidecar's tensor-name contract: `plan()` derives
every packed name, dtype and shape from it and the config, before any weight is read.

Layout (PACK_LAYOUT, recorded in the sidecar key):
- FP8 / FP4 weights are dequantised with their E8M0 scales and requantised to int8 with one
  fp32 scale per output row (W8A8-style): `<family>.qweight` [.., in, out] (matmul layout:
  x @ W) and `<family>.qscale` [.., out].
- bf16/fp32 matrices used as matmuls are transposed to [in, out]; norms and vectors are kept.
- Per-layer tensors are stacked on a leading axis per group: `layers.*` (all main layers),
  `layers.csa.*` / `layers.hca.*` (compressed layers of that kind), `layers.hash.*` (tid2eid,
  as int32) and `layers.bias.*` (score-routed layers). MTP layers use the `mtp.` prefix.
- Routed experts are stacked rank-major, `[ranks, layers, experts/ranks, …]`, so the weights
  one rank serves are one contiguous byte range (one mapping per rank), not `layers` strided
  pieces. This departs from a leading layer axis on purpose.

Packing streams one layer at a time (`stream()`): peak memory is one layer's tensors, whatever
the depth. The same stream feeds the sidecar writer and the in-memory packer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from runtime.config import DeepSeekV4Config
from runtime.pack_plan import (  # noqa: F401 - the layout's names, re-exported for packers
    EXPERTS,
    I32,
    KEEP,
    PACK_FORMAT,
    PACK_LAYOUT,
    PACKER_VERSION,
    Q8,
    RULES,
    PackedTensor,
    PackPlan,
    Rule,
    Slot,
    T,
    rule_for,
)
from runtime.tensors import FP4, FP8, Param
from store.checkpoint import Checkpoint
from store.quant import dequant_fp4, dequant_fp8_block

# ---- transforms ----------------------------------------------------------------------------

def dequantize(ckpt: Checkpoint, config: DeepSeekV4Config, p: Param) -> torch.Tensor:
    """A parameter as float32, whatever its stored format (the reference path uses this too)."""
    w = ckpt.read(p.name)
    if p.fmt == FP8:
        return dequant_fp8_block(w, ckpt.read(p.scale_name), config.fp8_block)
    if p.fmt == FP4:
        return dequant_fp4(w, ckpt.read(p.scale_name), config.fp4_group)
    return w.float()


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] → (int8 [in, out], fp32 scale [out]) with w ≈ (q * scale).T."""
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.t().contiguous(), scale.to(torch.float32)


def pack_param(ckpt: Checkpoint, config: DeepSeekV4Config, p: Param, rule: Rule) -> tuple[torch.Tensor, ...]:
    if rule.transform == Q8:
        return quantize_rows(dequantize(ckpt, config, p))
    w = ckpt.read(p.name)
    if rule.transform == T:
        return (w.t().contiguous(),)
    if rule.transform == I32:
        return (w.to(torch.int32),)
    return (w.contiguous(),)


Part = tuple[str, tuple[int, ...], torch.Tensor]  # (packed name, leading index, slice)
LayerProgress = Callable[[int, int, str], None]  # (groups done, groups total, group name)


def stream(ckpt: Checkpoint, plan: PackPlan, progress: LayerProgress | None = None) -> Iterator[Part]:
    """Packed slices, one checkpoint group (top, layer, MTP layer) at a time."""
    total = len(plan.groups)
    for i, (group, plist) in enumerate(plan.groups):
        for p in plist:
            slot = plan.slots[p.name]
            for name, tensor in zip(slot.names, pack_param(ckpt, plan.config, p, slot.rule), strict=True):
                yield name, slot.index, tensor
        if progress:
            progress(i + 1, total, group)


_TORCH = {"I8": torch.int8, "F32": torch.float32, "BF16": torch.bfloat16, "I32": torch.int32,
          "I64": torch.int64}


def pack_in_memory(ckpt: Checkpoint, plan: PackPlan, progress: LayerProgress | None = None) -> dict[str, torch.Tensor]:
    """The no-sidecar path: the whole packed layout as host tensors."""
    out = {t.name: torch.empty(t.shape, dtype=_TORCH[t.dtype]) for t in plan.tensors.values()}
    for name, index, part in stream(ckpt, plan, progress):
        out[name][index] = part
    return out

