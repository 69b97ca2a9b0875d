"""The sidecar's streaming writer, and the sweep of crashed writers' staging files.

What the packer calls (runtime/weights/prepack.py):

    key  = source_key(model_dir, format=F, packer_version=V, ranks=R, layout=L)  # BEFORE packing
    shapes = [TensorShape(t.name, t.dtype, t.shape) for t in packed.tensors.values()]
    info = write_sidecar(path, shapes, runtime.weights.pack.stream(ckpt, packed),
                         metadata=sidecar_metadata(key, model_dir), mode_from=a_shard)

The stream may yield whole tensors `(name, tensor)` or slices of stacked ones
`(name, leading_index, slice)`, in any order, so the packer streams one layer at a time and
never assembles a stacked tensor in memory. Each slice is checked against the layout, written at
its precomputed offset (gathered into whole 2 MiB blocks: `store.sidecar.blocks`), and
released; a slice given twice, or missing at the end, aborts the write (nothing is published).
`metadata["pack_seconds"]`, when given, is kept; otherwise the writer records the wall time from
the first tensor asked for to the last written.
A shard touched while packing is detected at the end: the sidecar is still published (stale,
never wrong) and `SidecarInfo.stale_detail` says so.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from store import atomic
from store.checkpoint import DTYPE_SIZES, MAX_HEADER_BYTES
from store.errors import UserError
from store.fingerprint import diff, fingerprint
from store.sidecar import checksum
from store.sidecar.blocks import BlockWriter, pwrite_all
from store.sidecar.files import check_target, sweep_temp_files
from store.sidecar.format import REQUIRED_METADATA, TensorShape, encode_header, is_int, layout
from store.sidecar.key import change_text, key_from_metadata, recompute_key
from store.units import format_size

if TYPE_CHECKING:
    import torch

log = logging.getLogger("store.sidecar")


@dataclass(frozen=True)
class SidecarInfo:
    path: Path
    size_bytes: int
    tensors: int
    pack_seconds: float
    source_fingerprint: str
    swept: tuple[Path, ...] = ()  # crash leftovers removed from the directory first
    stale_detail: str = ""  # non-empty: the checkpoint changed while packing


# (name, tensor) for a whole tensor, or (name, leading index, slice) for part of a stacked one
Part = tuple[str, "torch.Tensor"] | tuple[str, tuple[int, ...], "torch.Tensor"]
# progress(bytes_written, bytes_total)
WriteProgress = Callable[[int, int], None]


def _write_tensor(out: BlockWriter, tensor: torch.Tensor, offset: int, u8: torch.dtype) -> None:
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(u8)
    out.write(raw.numpy(), offset)


class _Coverage:
    """Which slices of each planned tensor have been written: each exactly once, all of them."""

    def __init__(self, placed: list[tuple[TensorShape, int]]) -> None:
        self.placed = {p.name: (p, offset) for p, offset in placed}
        self.depth: dict[str, int] = {}
        self.written: dict[str, set[tuple[int, ...]]] = {}

    def locate(
        self, name: str, index: tuple[int, ...], tensor: Any, dtypes: dict
    ) -> tuple[int, int]:
        """(data offset, byte count) of this slice, after checking it against the layout."""
        if name not in self.placed:
            raise ValueError(f"tensor stream yielded {name!r}, which is not in the layout")
        p, offset = self.placed[name]
        k = len(index)
        lead, rest = p.shape[:k], p.shape[k:]
        if k > len(p.shape) or not all(
            is_int(i) and 0 <= i < d for i, d in zip(index, lead, strict=True)
        ):
            raise ValueError(f"{name}: index {index} is outside its leading dims {lead}")
        if self.depth.setdefault(name, k) != k:
            raise ValueError(f"{name}: slices mix index depths {self.depth[name]} and {k}")
        seen = self.written.setdefault(name, set())
        if index in seen:
            raise ValueError(f"{name}: slice {index} yielded twice")
        if tensor.dtype != dtypes[p.dtype]:
            raise ValueError(f"{name}: dtype {tensor.dtype} but the layout says {p.dtype}")
        if tuple(tensor.shape) != rest:
            raise ValueError(f"{name}{list(index)}: shape {tuple(tensor.shape)}, the layout says {rest}")
        seen.add(index)
        nbytes = math.prod(rest) * DTYPE_SIZES[p.dtype]
        flat = 0
        for i, d in zip(index, lead, strict=True):
            flat = flat * d + i
        return offset + flat * nbytes, nbytes

    def incomplete(self) -> list[str]:
        out = []
        for name, (p, _) in self.placed.items():
            want = math.prod(p.shape[: self.depth.get(name, 0)])
            got = len(self.written.get(name, ()))
            if got != want and p.nbytes:
                out.append(f"{name} ({got} of {want} slices)" if got else f"{name} (missing)")
        return out


def _part(item: tuple) -> tuple[str, tuple[int, ...], Any]:
    if len(item) == 2:
        return item[0], (), item[1]
    name, index, tensor = item
    return name, tuple(index), tensor


def _planned(shapes: list[TensorShape], metadata: dict[str, str]
             ) -> tuple[dict[str, dict], list[tuple[TensorShape, int]], dict[str, str], bytes]:
    """The header a sidecar of `shapes` starts with: entries, placement, metadata and bytes."""
    entries, placed = layout(shapes)
    meta = dict(metadata)
    meta.setdefault("created", f"{time.time():.3f}")
    meta.setdefault("pack_seconds", "0")
    meta.update(checksum.placeholder(sum(p.nbytes for p in shapes)))  # same length as the digests
    header = encode_header(entries, meta, None)
    if len(header) - 8 > MAX_HEADER_BYTES:
        raise ValueError(f"header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    return entries, placed, meta, header


def planned_bytes(shapes: list[TensorShape], metadata: dict[str, str]) -> int:
    """The size `write_sidecar` gives the file of `shapes` with `metadata`, known before packing
    (no torch): its header, reserved once, plus every tensor's bytes."""
    shapes = list(shapes)
    return len(_planned(shapes, metadata)[3]) + sum(p.nbytes for p in shapes)


def write_sidecar(
    path: Path | str,
    shapes: list[TensorShape],
    tensors: Iterable[Part],
    *,
    metadata: dict[str, str],
    mode_from: Path | str | None = None,
    force: bool = False,
    progress: WriteProgress | None = None,
    pack_seconds: Callable[[], float] | None = None,
) -> SidecarInfo:
    """Stream `tensors` into a sidecar at `path`, published in one rename.

    Items are `(name, tensor)` for a whole planned tensor or `(name, index, slice)` for the
    slice at leading index `index` of a stacked one (`runtime.weights.pack.stream` yields these), in
    any order; each is checked against the layout and written at its offset as it arrives, and
    every slice must come exactly once. The header comes from the packed layout and is written before
    the first item is consumed; only one item is held at a time. The file gets `mode_from`'s
    permission bits (a checkpoint shard), else 0644 & ~umask. A crash leaves only a staging file,
    which later writers sweep.

    `pack_seconds`, when given, is asked after the last item and recorded (the packer times
    packing alone, which is what a repack at load time costs); else the writer's wall time is.
    """
    path = Path(path)
    missing = [
        k for k in REQUIRED_METADATA if k not in metadata and k not in ("created", "pack_seconds")
    ]
    if missing:
        raise ValueError(f"sidecar metadata lacks {missing} (use sidecar_metadata(key, model_dir))")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("sidecar metadata must map str to str")
    if fingerprint(key_from_metadata(metadata)) != metadata["source_fingerprint"]:
        raise ValueError("metadata source_fingerprint is not the fingerprint of its source_key")
    check_target(path, metadata)
    if path.exists() and not force:
        raise UserError(f"{path} already exists; pass --force to replace it")
    if not path.parent.is_dir():
        raise UserError(f"{path.parent}: no such directory; create it or choose another path")
    mode = stat.S_IMODE(os.stat(mode_from).st_mode) if mode_from is not None else None
    swept = tuple(sweep_temp_files(path.parent))

    shapes = list(shapes)
    keep_pack_seconds = "pack_seconds" in metadata
    entries, placed, meta, header = _planned(shapes, metadata)
    data_bytes = sum(p.nbytes for p in shapes)
    total = len(header) + data_bytes

    from store.sidecar.loader import torch_dtypes

    dtypes = torch_dtypes()
    start = time.monotonic()
    try:
        with atomic.staged_file(path, mode, replace=force) as (tmp, f):
            fd = f.fileno()
            _reserve(fd, total)
            pwrite_all(fd, header, 0)  # on disk first: what is being written shows from the start
            out = BlockWriter(fd, total)  # whole 2 MiB blocks: huge folios, so a map is fast
            out.write(header, 0)  # counted in its block, which is written whole again
            data_start, done = len(header), len(header)
            coverage = _Coverage(placed)
            for item in tensors:
                name, index, tensor = _part(item)
                offset, nbytes = coverage.locate(name, index, tensor, dtypes)
                if nbytes:
                    _write_tensor(out, tensor, data_start + offset, dtypes["U8"])
                del item, tensor  # released before the next one is packed
                done += nbytes
                if progress is not None:
                    progress(done, total)
            incomplete = coverage.incomplete()
            if incomplete:
                shown = ", ".join(incomplete[:5]) + (", …" if len(incomplete) > 5 else "")
                raise ValueError(f"tensor stream ended with {len(incomplete)} incomplete: {shown}")
            out.flush()
            seconds = pack_seconds() if pack_seconds is not None else time.monotonic() - start
            if not keep_pack_seconds:
                meta["pack_seconds"] = f"{seconds:.6f}"
            meta.update(_checksums(tmp, f, data_start, data_bytes))
            pwrite_all(fd, encode_header(entries, meta, len(header) - 8), 0)
    except FileExistsError:
        raise UserError(f"{path} appeared while writing; pass --force to replace it") from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(
                f"{path}: no space for {format_size(total)} ({e.strerror}); free space or "
                "write the sidecar elsewhere"
            ) from None
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise UserError(
                f"{path.parent}: cannot write the sidecar here ({e.strerror}); write it "
                "elsewhere with --out"
            ) from None
        raise

    stale = ""
    if "source_dir" in metadata:
        try:
            stored = key_from_metadata(metadata)
            live = recompute_key(stored, metadata, path)
            if fingerprint(live) != metadata["source_fingerprint"]:
                stale = ". ".join(change_text(c) for c in diff(stored, live))
                log.warning(
                    "sidecar %s: checkpoint changed while packing (%s): it is stale", path, stale
                )
        except UserError as e:
            stale = str(e)
            log.warning("sidecar %s: checkpoint unreadable after packing: %s", path, e)
    return SidecarInfo(
        path,
        total,
        len(shapes),
        float(meta["pack_seconds"]),
        metadata["source_fingerprint"],
        swept,
        stale,
    )


def _checksums(tmp: Path, f: Any, data_start: int, data_bytes: int) -> dict[str, str]:
    """Per-chunk checksums of the data as written, read back through a second fd (the
    staging file is open write-only); mostly from the page cache the writes just filled."""
    f.flush()
    rfd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return checksum.compute(rfd, data_start, data_bytes)
    finally:
        os.close(rfd)


def _reserve(fd: int, total: int) -> None:
    """Claim the space up front so a full disk fails before hours of packing, not after."""
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        os.ftruncate(fd, total)  # filesystems without fallocate: at least fix the size
