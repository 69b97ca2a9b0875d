"""Packing: checkpoint tensors → the serving layout the programs consume (and sidecars hold).

`RULES` is the one table of packing: one row per tensor family, naming the transform and the
group the family is stacked in. It is also the sidecar's tensor-name contract: `PackedLayout` derives
every packed name, dtype and shape from it and the config, before any weight is read.

Layout (PACK_LAYOUT, recorded in the sidecar key):
- FP8 / FP4 weights keep the checkpoint's codes: `<family>.qweight` in the matmul layout (x @ W)
  holds FP8 as stored [.., in, out] and FP4 packed [.., in/2, out] (the checkpoint's bytes
  transposed whole: each byte two e2m1 codes of neighbouring inputs, their bits placed for the
  eager decode by `serving_fp4`), `<family>.qscale` [.., in/block, out/block] the E8M0 block
  scales as bytes. The programs dequantise where they multiply; nothing is requantised or
  widened, so the packed model is the checkpoint's model at the checkpoint's size (tests: packed
  logits equal the float reference to float rounding).
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

from runtime.model.config import DeepSeekV4Config
from runtime.model.tensors import FP4, FP8, Param
from runtime.weights.layout import (  # noqa: F401 - the layout's names, re-exported for packers
    EXPERTS,
    I32,
    KEEP,
    PACK_FORMAT,
    PACK_LAYOUT,
    PACKER_VERSION,
    QUANT,
    RULES,
    PackedLayout,
    PackedTensor,
    Rule,
    Slot,
    T,
    rule_for,
)
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


def pack_quant(ckpt: Checkpoint, p: Param) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-quantised parameter as (qweight [in, out] — FP4: [in/2, out] —, qscale [in/block,
    out/block] E8M0 bytes): the checkpoint's bytes transposed whole (so a byte's two FP4 codes stay
    neighbouring inputs), FP4's bits placed for serving (`serving_fp4`)."""
    scale = ckpt.read(p.scale_name).view(torch.uint8)
    if p.fmt == FP8:
        return ckpt.read(p.name).t().contiguous(), scale.t().contiguous()
    if p.fmt == FP4:
        return serving_fp4(ckpt.read(p.name).view(torch.uint8).t().contiguous()), scale.t().contiguous()
    raise ValueError(f"{p.name}: {p.fmt} is not a block-quantised format")


def serving_fp4(b: torch.Tensor) -> torch.Tensor:
    """FP4 bytes as the checkpoint stores them (uint8: the even input's e2m1 code in bits 0-3, the
    odd one's in 4-7, each sign its top bit) → the same codes as the serving layout holds them:
    the even code's three bits of magnitude in bits 0-2, the odd one's in 3-5, the even sign in
    bit 6, the odd in 7 (`PACK_LAYOUT`). Same bytes, same numbers, bits moved so that the eager
    decode takes one shift and one mask a byte (`codes.fp4_float16`); every decoder reads this
    order."""
    # the even code's magnitude and the odd one's sign stay; the odd magnitude (bits 4-6) moves
    # to 3-5, the even sign (bit 3) to 6 (a uint8 shift drops what passes bit 7)
    return (b & 0x87) | ((b >> 1) & 0x38) | ((b << 3) & 0x40)


def pack_param(ckpt: Checkpoint, config: DeepSeekV4Config, p: Param, rule: Rule) -> tuple[torch.Tensor, ...]:
    if rule.transform == QUANT:
        return pack_quant(ckpt, p)
    w = ckpt.read(p.name)
    if rule.transform == T:
        return (w.t().contiguous(),)
    if rule.transform == I32:
        return (w.to(torch.int32),)
    return (w.contiguous(),)


Part = tuple[str, tuple[int, ...], torch.Tensor]  # (packed name, leading index, slice)
LayerProgress = Callable[[int, int, str], None]  # (groups done, groups total, group name)


def stream(ckpt: Checkpoint, packed: PackedLayout, progress: LayerProgress | None = None,
           rank: int | None = None) -> Iterator[Part]:
    """Packed slices, one checkpoint group (top, layer, MTP layer) at a time; with `rank`, of
    the routed experts only that rank's (the others are not even read)."""
    total = len(packed.groups)
    for i, (group, plist) in enumerate(packed.groups):
        for p in plist:
            slot = packed.slots[p.name]
            if rank is not None and slot.rule.group == EXPERTS and slot.index[0] != rank:
                continue
            for name, tensor in zip(slot.names, pack_param(ckpt, packed.config, p, slot.rule), strict=True):
                yield name, slot.index, tensor
        if progress:
            progress(i + 1, total, group)


_TORCH = {"I8": torch.int8, "F32": torch.float32, "BF16": torch.bfloat16, "I32": torch.int32,
          "I64": torch.int64, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn}


def pack_in_memory(ckpt: Checkpoint, packed: PackedLayout, progress: LayerProgress | None = None,
                   rank: int | None = None) -> dict[str, torch.Tensor]:
    """The no-sidecar path: the whole packed layout as host tensors; with `rank`, the routed
    experts of that rank only (shaped as `rank_slice` cuts them from a whole layout)."""
    out = {t.name: torch.empty((1, *t.shape[1:]) if rank is not None and t.rule.group == EXPERTS else t.shape,
                               dtype=_TORCH[t.dtype]) for t in packed.tensors.values()}
    for name, index, part in stream(ckpt, packed, progress, rank):
        if rank is not None and packed.tensors[name].rule.group == EXPERTS:
            index = (0, *index[1:])
        out[name][index] = part
    return out


def rank_slice(packed: PackedLayout, tensors: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """One rank's share of a packed layout: every shared tensor, and of each rank-major routed
    expert tensor `[ranks, layers, E/r, …]` only `[rank:rank+1]` — one contiguous byte range."""
    return {n: t[rank:rank + 1] if packed.tensors[n].rule.group == EXPERTS else t for n, t in tensors.items()}

