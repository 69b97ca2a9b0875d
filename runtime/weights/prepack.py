"""Prepack: pack a checkpoint once into a sidecar, and judge a sidecar as the loader would.

The packing rules are `runtime.weights.pack`'s; the file format, writer and verdicts are
`store.sidecar`'s. This module joins them: the live key (format, packer version, ranks and
layout as this packer would write them, plus the checkpoint's config, index and shards) and the
expected tensor names (from the packed layout), so a sidecar written by an older packer, for other
ranks, or with another tensor set reads as REPACK with the reason — not only a changed
checkpoint.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from runtime.model.config import load_config
from runtime.weights import layout
from store import sidecar
from store.checkpoint import Checkpoint
from store.errors import UserError
from store.fingerprint import Key
from store.units import format_size

T = TypeVar("T")


def sidecar_key(model_dir: Path | str, ranks: int, config: bytes | None = None) -> Key:
    """The key a sidecar of `model_dir` for `ranks` must carry to be current for this packer
    (`config`: config.json's bytes as a launch read them, else read here)."""
    # Read through the module so a bumped (or monkeypatched) PACKER_VERSION is seen.
    return sidecar.source_key(
        model_dir,
        format=layout.PACK_FORMAT,
        packer_version=layout.PACKER_VERSION,
        ranks=ranks,
        layout=layout.PACK_LAYOUT,
        config=config,
    )


def packed_layout(model_dir: Path | str, ranks: int) -> layout.PackedLayout:
    """Every packed tensor of `model_dir` for `ranks`, from config.json alone (no weights read)."""
    return layout.PackedLayout(load_config(model_dir), ranks)


def sidecar_tensors(packed: layout.PackedLayout) -> list[sidecar.TensorShape]:
    """The packed layout as the sidecar sees it: each tensor's name, dtype and shape."""
    return [sidecar.TensorShape(t.name, t.dtype, t.shape) for t in packed.tensors.values()]


@dataclass(frozen=True)
class SidecarSize:
    """What a prepack writes, known before it packs anything (from config.json; no torch)."""

    path: Path
    expected_bytes: int  # the file: header and every packed tensor
    checkpoint_bytes: int  # the checkpoint's tensors (weights and scales) for the same config
    free_bytes: int | None  # free space in the directory it goes to; None: unknown

    @property
    def fits(self) -> bool:
        return self.free_bytes is None or self.expected_bytes <= self.free_bytes

    def to_json(self) -> dict[str, int | bool | None]:
        return {"expected_bytes": self.expected_bytes, "checkpoint_bytes": self.checkpoint_bytes,
                "free_bytes": self.free_bytes, "fits": self.fits}

    def refusal(self) -> str:
        """The one line a prepack that would not fit stops with."""
        return (f"{self.path}: a prepack writes {format_size(self.expected_bytes)} but "
                f"{self.path.parent} has {format_size(self.free_bytes or 0)} free; free space "
                "or write the sidecar elsewhere with --out")


def free_bytes(directory: Path) -> int | None:
    """Free space for an unprivileged writer under `directory` (its nearest existing parent)."""
    for d in (directory, *directory.parents):
        if d.is_dir():
            try:
                return shutil.disk_usage(d).free
            except OSError:
                return None
    return None


def sidecar_size(model_dir: Path | str, ranks: int, path: Path | str | None = None,
                 packed: layout.PackedLayout | None = None, key: Key | None = None) -> SidecarSize:
    """The size of the sidecar a prepack of `model_dir` for `ranks` would write at `path`
    (default: beside the checkpoint): the writer's own header and layout arithmetic."""
    model_dir = _checkpoint_dir(model_dir)
    packed = packed if packed is not None else packed_layout(model_dir, ranks)
    path = Path(path).expanduser() if path is not None else sidecar.default_sidecar_path(model_dir, ranks)
    metadata = sidecar.sidecar_metadata(key or sidecar_key(model_dir, ranks), model_dir)
    expected = sidecar.planned_bytes(sidecar_tensors(packed), metadata)
    return SidecarSize(path, expected, packed.checkpoint_bytes(), free_bytes(path.parent))


def _checkpoint_dir(model_dir: Path | str) -> Path:
    path = Path(model_dir).expanduser()
    if not path.is_dir():
        raise UserError(f"{path}: no such checkpoint directory")
    return path


@dataclass(frozen=True)
class PrepackProgress:
    """Where a prepack is: groups (top, each layer, each MTP layer) and bytes written."""

    layer: int  # groups fully packed and written
    layers: int
    group: str  # the last group finished ("" before the first)
    bytes_done: int
    bytes_total: int
    seconds: float

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_done / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        rate = self.bytes_per_s
        return (self.bytes_total - self.bytes_done) / rate if rate > 0 else None


def _timed(items: Iterable[T], spent: list[float]) -> Iterator[T]:
    """`items`, adding the time spent producing each (packing, not writing) to spent[0]."""
    it = iter(items)
    while True:
        t0 = time.monotonic()
        try:
            item = next(it)
        except StopIteration:
            spent[0] += time.monotonic() - t0
            return
        spent[0] += time.monotonic() - t0
        yield item


def prepack(
    model_dir: Path | str,
    *,
    ranks: int = 1,
    out: Path | str | None = None,
    force: bool = False,
    progress: Callable[[PrepackProgress], None] | None = None,
) -> sidecar.SidecarInfo:
    """Pack `model_dir` for `ranks` into a sidecar (default: beside the checkpoint).

    The key is taken before any weight is read, so a shard changed while packing leaves a
    sidecar that is stale (`SidecarInfo.stale_detail`), never one that claims the new shard.
    Memory stays at about one layer: `pack.stream` packs a layer at a time and the writer
    writes each slice at its offset and drops it. Refuses to replace an existing file unless
    `force`. Staging files of crashed writers in the target dir are swept (`info.swept`).
    """
    from runtime.weights.pack import stream  # torch: only packing needs it

    model_dir = _checkpoint_dir(model_dir)
    key = sidecar_key(model_dir, ranks)  # BEFORE packing starts
    packed = packed_layout(model_dir, ranks)
    path = (
        Path(out).expanduser()
        if out is not None
        else sidecar.default_sidecar_path(model_dir, ranks)
    )
    if path.is_dir():
        path = sidecar.default_sidecar_path(path, ranks)
    if path.exists() and not force:
        raise UserError(f"{path} already exists; pass --force to replace it")
    size = sidecar_size(model_dir, ranks, path, packed, key)
    if not size.fits:  # the staging file is whole before the rename frees an old one
        raise UserError(size.refusal())
    ckpt = Checkpoint.open(model_dir)
    shards = ckpt.shard_paths()
    tensors = sidecar_tensors(packed)

    start = time.monotonic()
    spent = [0.0]
    state = {"layer": 0, "group": "", "done": 0, "total": 0}

    def report() -> None:
        if progress is not None:
            progress(PrepackProgress(state["layer"], len(packed.groups), state["group"],
                                     state["done"], state["total"], time.monotonic() - start))  # fmt: skip

    def on_layer(done: int, total: int, group: str) -> None:
        state.update(layer=done, group=group)
        report()

    def on_bytes(done: int, total: int) -> None:
        state.update(done=done, total=total)
        report()

    try:
        return sidecar.write_sidecar(
            path,
            tensors,
            _timed(stream(ckpt, packed, on_layer), spent),
            metadata=sidecar.sidecar_metadata(key, model_dir),
            mode_from=shards[0] if shards else None,
            force=force,
            progress=on_bytes,
            pack_seconds=lambda: spent[0],
        )
    finally:
        ckpt.close()


def judge(
    model_dir: Path | str,
    ranks: int = 1,
    path: Path | str | None = None,
    *,
    cold_policy: str = "auto",
    cold_threshold: float = sidecar.DEFAULT_COLD_THRESHOLD,
    residency_method: str | None = None,
    packed: layout.PackedLayout | None = None,
    key: Key | None = None,
) -> sidecar.Verdict:
    """The verdict loading would give the sidecar at `path` (default: beside the checkpoint):
    against the live key and the packed layout's tensors, so a new packer version or layout,
    other ranks and a different tensor set are REPACK too, not only a changed checkpoint. A
    caller that already built the layout or the live key passes them (`packed`, `key`)."""
    model_dir = _checkpoint_dir(model_dir)
    packed = packed if packed is not None else packed_layout(model_dir, ranks)
    return sidecar.inspect(
        path if path is not None else sidecar.default_sidecar_path(model_dir, ranks),
        expected_key=key or sidecar_key(model_dir, ranks),
        expected_tensors=sidecar_tensors(packed),
        cold_policy=cold_policy,
        cold_threshold=cold_threshold,
        residency_method=residency_method,
    )


def open_prepacked(
    model_dir: Path | str,
    ranks: int = 1,
    path: Path | str | None = None,
    *,
    cold_policy: str = "auto",
    cold_threshold: float = sidecar.DEFAULT_COLD_THRESHOLD,
    packed: layout.PackedLayout | None = None,
    config: bytes | None = None,
) -> tuple[sidecar.Verdict, sidecar.MappedSidecar | None]:
    """Judge and, on MAP, map the sidecar (`store.sidecar.open_sidecar` with the live key and
    names); on REPACK the caller packs from the checkpoint (`pack.pack_in_memory`). A caller
    that already built the layout and read config.json (registration, from its plan) passes them
    (`packed`, `config`): the shards are stat'ed again, so one changed since the plan is seen."""
    model_dir = _checkpoint_dir(model_dir)
    packed = packed if packed is not None else packed_layout(model_dir, ranks)
    return sidecar.open_sidecar(
        path if path is not None else sidecar.default_sidecar_path(model_dir, ranks),
        expected_key=sidecar_key(model_dir, ranks, config),
        expected_tensors=sidecar_tensors(packed),
        cold_policy=cold_policy,
        cold_threshold=cold_threshold,
    )
