"""Prepacked weight sidecars: the file format, its streaming writer, verdicts and the loader.

A sidecar is a safetensors file (any `safetensors` reader loads it) holding the packed serving
layout of one checkpoint for one (ranks, layout). The packing rules live in runtime/pack.py;
this module only knows plans, bytes and keys. What the packer calls:

    key  = source_key(model_dir, format=F, packer_version=V, ranks=R, layout=L)  # BEFORE packing
    plan = [TensorPlan(t.name, t.dtype, t.shape) for t in pack_plan.tensors.values()]
    info = write_sidecar(path, plan, runtime.pack.stream(ckpt, pack_plan),
                         metadata=sidecar_metadata(key, model_dir),
                         mode_from=a_shard, force=False, progress=cb)
    verdict, mapped = open_sidecar(path, expected_key=key, expected_names=names)
    if mapped: use mapped.tensors (zero-copy, read-only views); mapped.close() when done
    else:      pack from the checkpoint (verdict.reason / verdict.detail say why)

Differences from the brief, all additive:
- `expected_key=None` makes `inspect`/`open_sidecar` judge a sidecar on its own: the key is
  recomputed from the checkpoint dir and the settings recorded in the sidecar (`source_dir`,
  `source_key`). `dsv4 sidecar status` uses this until the packer's settings are importable.
- The loader class is `MappedSidecar` (not `Mapping`, which would shadow collections.abc).
- The stream may yield whole tensors `(name, tensor)` or slices of stacked ones
  `(name, leading_index, slice)`, in any order, so the packer streams one layer at a time and
  never assembles a stacked tensor in memory. Each slice is checked against the plan, written at
  its precomputed offset (`pwrite`), and released; a slice given twice, or missing at the end,
  aborts the write (nothing is published).
- Data layout: tensors are laid out in plan order *grouped by element size* (8-byte dtypes
  first), so every zero-copy view is naturally aligned.
- `metadata["pack_seconds"]`, when the caller gives it, is kept (the packer may time packing
  alone); otherwise the writer records the wall time from asking for the first tensor to
  writing the last (packing plus writing).
- Metadata also holds `source_dir` (the checkpoint dir, resolved), kept out of the key so a
  checkpoint moved together with its sidecar stays valid.
- A shard touched while packing is detected at the end of the write: the sidecar is still
  published (it is stale, never wrong) and `SidecarInfo.stale_detail` / the log say so.

The loader does everything through one file descriptor (fstat, header, validation, residency,
mmap), so a concurrent `os.replace` of the path can never mix two files in one load. The
mapping is MAP_SHARED + PROT_READ: page-cache pages are shared, never copied on write, and the
views are truly read-only — writing through one kills the process with SIGSEGV, so consumers
copy (`.clone()`, `.to(device)`) before any in-place op. Writers always publish by rename;
truncating a mapped sidecar in place would SIGBUS its readers, which is why nothing does.

This module imports torch only inside the functions that make or return tensors; the console
calls `inspect` without torch.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import mmap
import os
import stat
import struct
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from store import atomic, pagecache
from store.checkpoint import CONFIG_NAME, DTYPE_SIZES, INDEX_NAME, MAX_HEADER_BYTES
from store.errors import UserError
from store.fingerprint import Change, Key, diff, fingerprint, sha256_hex
from store.units import format_size

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

FILE_PREFIX = "dsv4-packed"
# Header JSON is padded with spaces so data starts on this boundary, and so the final header
# (with the measured pack seconds) fits in the space reserved before any tensor was written.
DATA_ALIGN = 64
HEADER_SLACK = 64

REQUIRED_METADATA = (
    "format", "packer_version", "source_fingerprint", "source_key", "ranks", "created",
    "pack_seconds",
)  # fmt: skip

MAP, REPACK = "MAP", "REPACK"
REASONS = ("missing", "stale", "cold", "corrupt", "names")
COLD_POLICIES = ("reject", "read", "auto")
DEFAULT_COLD_THRESHOLD = 0.9

# A staging file older than this whose writer cannot be seen alive is a crash leftover.
STALE_TEMP_SECONDS = 15 * 60


# ---------------------------------------------------------------------------------------------
# Names and keys


def default_sidecar_path(model_dir: Path | str, ranks: int) -> Path:
    """Where the sidecar for `ranks` lives: beside the checkpoint."""
    return Path(model_dir) / f"{FILE_PREFIX}.r{int(ranks)}.safetensors"


def find_sidecars(model_dir: Path | str) -> list[Path]:
    """The published sidecars beside a checkpoint (staging files are never listed)."""
    return sorted(Path(model_dir).glob(f"{FILE_PREFIX}.r*.safetensors"))


def _checkpoint_file(model_dir: Path, name: str) -> bytes:
    path = model_dir / name
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{path}: not found; point at a checkpoint directory") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror}); check its permissions") from None


def source_key(
    model_dir: Path | str, *, format: str, packer_version: str, ranks: int, layout: dict
) -> Key:
    """The key of the checkpoint a sidecar is packed from. Compute it BEFORE packing starts.

    Components: format, packer version, ranks, layout, config.json's sha256, the weight_map's
    sha256, then one `shard:<name>` component (size, mtime_ns) per shard, so a stale sidecar
    names the very shard that changed. A shard that is gone reads as "<missing>".
    """
    model_dir = Path(model_dir)
    config = _checkpoint_file(model_dir, CONFIG_NAME)
    try:
        weight_map = json.loads(_checkpoint_file(model_dir, INDEX_NAME))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{model_dir / INDEX_NAME}: not a safetensors index ({e})") from None
    components: list[tuple[str, Any]] = [
        ("format", format),
        ("packer_version", packer_version),
        ("ranks", int(ranks)),
        ("layout", layout),
        ("config_sha256", sha256_hex(config)),
        ("weight_map_sha256", sha256_hex(json.dumps(weight_map, sort_keys=True))),
    ]
    for shard in sorted(set(map(str, weight_map.values()))):
        try:
            st = os.stat(model_dir / shard)
            value: Any = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        except FileNotFoundError:
            value = "<missing>"
        components.append((f"shard:{shard}", value))
    return Key.of(components)


def sidecar_metadata(key: Key, model_dir: Path | str, **extra: str) -> dict[str, str]:
    """The metadata `write_sidecar` needs, from the source key (plus any extra str→str)."""
    parts = key.as_dict()
    return {
        "format": str(parts["format"]),
        "packer_version": str(parts["packer_version"]),
        "ranks": str(parts["ranks"]),
        "source_fingerprint": fingerprint(key),
        "source_key": json.dumps(key.to_json(), separators=(",", ":")),
        "source_dir": str(Path(model_dir).resolve()),
        **extra,
    }


def _key_from_metadata(metadata: dict[str, str]) -> Key:
    return Key.from_json(json.loads(metadata["source_key"]))


def _recompute_key(stored: Key, metadata: dict[str, str], sidecar: Path) -> Key:
    """The live key of the checkpoint this sidecar says it came from, with its own settings."""
    parts = stored.as_dict()
    model_dir = Path(metadata.get("source_dir") or sidecar.parent)
    return source_key(
        model_dir,
        format=parts.get("format", ""),
        packer_version=parts.get("packer_version", ""),
        ranks=int(parts.get("ranks", 0)),
        layout=parts.get("layout", {}),
    )


# ---------------------------------------------------------------------------------------------
# Plans and the header


@dataclass(frozen=True)
class TensorPlan:
    """One tensor the packer will produce: known before any tensor is packed."""

    name: str
    dtype: str  # safetensors dtype string: "I8", "F32", "BF16", …
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"{self.name}: unsupported dtype {self.dtype!r}")
        shape = tuple(self.shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"{self.name}: shape must be non-negative ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor as the header places it: [begin, end) are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    header_bytes: int  # N, the JSON length after the 8-byte prefix
    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str] = field(hash=False)

    @property
    def data_start(self) -> int:
        return 8 + self.header_bytes

    @property
    def names(self) -> frozenset[str]:
        return frozenset(e.name for e in self.entries)


class CorruptSidecar(Exception):
    """The file is not a sound sidecar; the message says what is wrong."""


def _encode_header(entries: dict[str, dict], metadata: dict[str, str], size: int | None) -> bytes:
    """The 8-byte length plus JSON padded with spaces to `size` (or to the alignment + slack)."""
    body = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    if size is None:
        size = len(body) + HEADER_SLACK
        size += -(8 + size) % DATA_ALIGN
    if len(body) > size:
        raise ValueError(f"header grew past its reserved {size} bytes")
    return struct.pack("<Q", size) + body + b" " * (size - len(body))


def _layout(plan: list[TensorPlan]) -> tuple[dict[str, dict], list[tuple[TensorPlan, int]]]:
    """Header entries (in plan order) and each plan entry's data offset, size-aligned."""
    names = [p.name for p in plan]
    if len(names) != len(set(names)):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names in plan: {dup[:5]}")
    if "__metadata__" in names:
        raise ValueError("'__metadata__' is not a tensor name")
    offsets: dict[str, int] = {}
    pos = 0
    for p in sorted(plan, key=lambda p: -DTYPE_SIZES[p.dtype]):  # stable: plan order kept
        offsets[p.name] = pos
        pos += p.nbytes
    entries = {
        p.name: {
            "dtype": p.dtype,
            "shape": list(p.shape),
            "data_offsets": [offsets[p.name], offsets[p.name] + p.nbytes],
        }
        for p in plan
    }
    return entries, [(p, offsets[p.name]) for p in plan]


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    chunks, done = [], 0
    while done < n:
        chunk = os.pread(fd, n - done, offset + done)
        if not chunk:
            raise CorruptSidecar(f"truncated: file ends at byte {offset + done} inside the header")
        chunks.append(chunk)
        done += len(chunk)
    return b"".join(chunks)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise CorruptSidecar(f"header names {k!r} twice")
        seen[k] = v
    return seen


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(fd: int, file_size: int) -> Header:
    """Parse and check a safetensors header from `fd`; CorruptSidecar says what is wrong.

    Nothing is allocated from a size the file claims before that size is checked against the
    file and MAX_HEADER_BYTES, and every tensor's bytes must lie inside the file, agree with its
    dtype and shape, and tile the data region exactly (no overlap, gap or trailing bytes).
    """
    if file_size < 8:
        raise CorruptSidecar(f"truncated: {file_size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0))
    if n > MAX_HEADER_BYTES:
        raise CorruptSidecar(f"header length {n} exceeds the {format_size(MAX_HEADER_BYTES)} limit")
    if 8 + n > file_size:
        raise CorruptSidecar(f"header length {n} runs past the end of the file ({file_size} bytes)")
    try:
        raw = json.loads(_pread_exact(fd, n, 8).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptSidecar(f"header is not valid JSON ({type(e).__name__}: {e})"[:200]) from None
    if not isinstance(raw, dict):
        raise CorruptSidecar("header is not a JSON object")
    metadata = raw.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CorruptSidecar("__metadata__ is not an object of strings")
    data_start, data_len = 8 + n, file_size - 8 - n
    entries = []
    for name, info in raw.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CorruptSidecar(f"{name}: entry needs exactly dtype, shape and data_offsets")
        dtype, shape, offs = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in DTYPE_SIZES:
            raise CorruptSidecar(f"{name}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CorruptSidecar(f"{name}: shape {shape!r} is not a list of non-negative ints")
        if not (isinstance(offs, list) and len(offs) == 2 and all(map(_is_int, offs))):
            raise CorruptSidecar(f"{name}: data_offsets {offs!r} is not [begin, end]")
        begin, end = offs
        if not 0 <= begin <= end:
            raise CorruptSidecar(f"{name}: data_offsets [{begin}, {end}] are not ordered")
        if end > data_len:
            raise CorruptSidecar(
                f"{name}: data_offsets end {end} is past the end of the data ({data_len} bytes)"
            )
        # Python ints do not overflow; a product larger than the file simply disagrees.
        want = math.prod(shape) * DTYPE_SIZES[dtype]
        if want != end - begin:
            raise CorruptSidecar(
                f"{name}: {dtype}{shape} needs {want} bytes but data_offsets span {end - begin}"
            )
        entries.append(TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end))
    pos, prev = data_start, None
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin < pos:
            raise CorruptSidecar(f"tensors {prev} and {e.name} overlap")
        if e.begin > pos:
            raise CorruptSidecar(f"gap of {e.begin - pos} bytes before tensor {e.name}")
        pos, prev = e.end, e.name
    if pos != file_size:
        raise CorruptSidecar(f"{file_size - pos} trailing bytes after the last tensor")
    return Header(n, tuple(entries), dict(metadata))


# ---------------------------------------------------------------------------------------------
# Writing


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


def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "F8_E8M0": torch.float8_e8m0fnu,
        "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
        "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
        "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64, "C64": torch.complex64,
    }  # fmt: skip


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_tensor(fd: int, tensor: torch.Tensor, offset: int, u8: torch.dtype) -> None:
    raw = tensor.detach().cpu().contiguous().reshape(-1).view(u8)
    _pwrite_all(fd, raw.numpy(), offset)


class _Coverage:
    """Which slices of each planned tensor have been written: each exactly once, all of them."""

    def __init__(self, placed: list[tuple[TensorPlan, int]]) -> None:
        self.placed = {p.name: (p, offset) for p, offset in placed}
        self.depth: dict[str, int] = {}
        self.written: dict[str, set[tuple[int, ...]]] = {}

    def locate(
        self, name: str, index: tuple[int, ...], tensor: Any, dtypes: dict
    ) -> tuple[int, int]:
        """(data offset, byte count) of this slice, after checking it against the plan."""
        if name not in self.placed:
            raise ValueError(f"tensor stream yielded {name!r}, which is not in the plan")
        p, offset = self.placed[name]
        k = len(index)
        lead, rest = p.shape[:k], p.shape[k:]
        if k > len(p.shape) or not all(
            _is_int(i) and 0 <= i < d for i, d in zip(index, lead, strict=True)
        ):
            raise ValueError(f"{name}: index {index} is outside its leading dims {lead}")
        if self.depth.setdefault(name, k) != k:
            raise ValueError(f"{name}: slices mix index depths {self.depth[name]} and {k}")
        seen = self.written.setdefault(name, set())
        if index in seen:
            raise ValueError(f"{name}: slice {index} yielded twice")
        if tensor.dtype != dtypes[p.dtype]:
            raise ValueError(f"{name}: dtype {tensor.dtype} but the plan says {p.dtype}")
        if tuple(tensor.shape) != rest:
            raise ValueError(f"{name}{list(index)}: shape {tuple(tensor.shape)}, plan says {rest}")
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


def write_sidecar(
    path: Path | str,
    plan: list[TensorPlan],
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
    slice at leading index `index` of a stacked one (`runtime.pack.stream` yields these), in
    any order; each is checked against the plan and written at its offset as it arrives, and
    every slice must come exactly once. The header comes from the plan and is written before
    the first item is consumed; only one item is held at a time. The file gets `mode_from`'s permission bits (a checkpoint
    shard), else 0644 & ~umask. A crash leaves only a staging file, which later writers sweep.

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
    if fingerprint(_key_from_metadata(metadata)) != metadata["source_fingerprint"]:
        raise ValueError("metadata source_fingerprint is not the fingerprint of its source_key")
    if path.exists() and not force:
        raise UserError(f"{path} already exists; pass --force to replace it")
    if not path.parent.is_dir():
        raise UserError(f"{path.parent}: no such directory; create it or choose another path")
    mode = stat.S_IMODE(os.stat(mode_from).st_mode) if mode_from is not None else None
    swept = tuple(sweep_temp_files(path.parent))

    plan = list(plan)
    entries, placed = _layout(plan)
    meta = dict(metadata)
    meta.setdefault("created", f"{time.time():.3f}")
    keep_pack_seconds = "pack_seconds" in meta
    meta.setdefault("pack_seconds", "0")
    header = _encode_header(entries, meta, None)
    if len(header) - 8 > MAX_HEADER_BYTES:
        raise ValueError(f"plan header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    data_bytes = sum(p.nbytes for p in plan)
    total = len(header) + data_bytes

    dtypes = _torch_dtypes()
    start = time.monotonic()
    try:
        with atomic.staged_file(path, mode, replace=force) as (_tmp, f):
            fd = f.fileno()
            _reserve(fd, total)
            _pwrite_all(fd, header, 0)
            data_start, done = len(header), len(header)
            coverage = _Coverage(placed)
            for item in tensors:
                name, index, tensor = _part(item)
                offset, nbytes = coverage.locate(name, index, tensor, dtypes)
                if nbytes:
                    _write_tensor(fd, tensor, data_start + offset, dtypes["U8"])
                del item, tensor  # released before the next one is packed
                done += nbytes
                if progress is not None:
                    progress(done, total)
            incomplete = coverage.incomplete()
            if incomplete:
                shown = ", ".join(incomplete[:5]) + (", …" if len(incomplete) > 5 else "")
                raise ValueError(f"tensor stream ended with {len(incomplete)} incomplete: {shown}")
            seconds = pack_seconds() if pack_seconds is not None else time.monotonic() - start
            if not keep_pack_seconds:
                meta["pack_seconds"] = f"{seconds:.6f}"
                _pwrite_all(fd, _encode_header(entries, meta, len(header) - 8), 0)
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
            stored = _key_from_metadata(metadata)
            live = _recompute_key(stored, metadata, path)
            if fingerprint(live) != metadata["source_fingerprint"]:
                stale = "; ".join(_change_text(c) for c in diff(stored, live))
                log.warning(
                    "sidecar %s: checkpoint changed while packing (%s): it is stale", path, stale
                )
        except UserError as e:
            stale = str(e)
            log.warning("sidecar %s: checkpoint unreadable after packing: %s", path, e)
    return SidecarInfo(
        path,
        total,
        len(plan),
        float(meta["pack_seconds"]),
        metadata["source_fingerprint"],
        swept,
        stale,
    )


def _reserve(fd: int, total: int) -> None:
    """Claim the space up front so a full disk fails before hours of packing, not after."""
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise
        os.ftruncate(fd, total)  # filesystems without fallocate: at least fix the size


def sweep_temp_files(
    directory: Path | str, *, min_age_s: float = STALE_TEMP_SECONDS, remove: bool = True
) -> list[Path]:
    """Staging files of crashed sidecar writers in `directory` (removed unless remove=False).

    A staging file counts as a leftover when its writer ran on this host and is gone, or, for
    writers on other hosts (shared filesystems), when it was not written for `min_age_s`. A live
    local writer's file is never touched (a reused pid keeps a leftover until that pid exits).
    """
    found = []
    now = time.time()
    try:
        candidates = list(Path(directory).iterdir())
    except OSError:
        return []
    for p in candidates:
        if not (atomic.is_staging(p.name) and ".safetensors." in p.name):
            continue
        pid = atomic.staging_writer_pid(p.name)
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        age = now - st.st_mtime
        leftover = not atomic.pid_alive(pid) if pid is not None else age >= min_age_s
        if not leftover:
            continue
        if remove:
            try:
                p.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                log.warning("cannot remove leftover sidecar staging file %s: %s", p, e)
                continue
            log.warning("removed leftover sidecar staging file %s (writer gone)", p)
        found.append(p)
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# Verdicts


@dataclass(frozen=True)
class Verdict:
    """MAP the sidecar, or REPACK from the checkpoint — and why, in data and in one sentence."""

    action: str  # MAP | REPACK
    reason: str  # "" for MAP; missing | stale | cold | corrupt | names
    detail: str
    path: str
    residency: float | None = None
    residency_method: str | None = None
    size_bytes: int = 0
    tensors: int = 0
    created: float | None = None
    pack_seconds: float | None = None
    changes: tuple[str, ...] = ()  # stale: each changed key component, "old → new"
    cold_read: bool = False  # MAP of a cold file: expect a read of the uncached bytes
    predicted_read_s: float | None = None
    predicted_pack_s: float | None = None
    read_bytes_per_s: float | None = None

    @property
    def mapped(self) -> bool:
        return self.action == MAP

    def line(self) -> str:
        """The one log line of this verdict."""
        head = f"sidecar {self.path}: {self.action}"
        return f"{head} ({self.reason}): {self.detail}" if self.reason else f"{head}: {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "verdict": self.action,
            "reason": self.reason,
            "detail": self.detail,
            "residency": self.residency,
            "residency_method": self.residency_method,
            "size_bytes": self.size_bytes,
            "tensors": self.tensors,
            "created": self.created,
            "age_seconds": None if self.created is None else max(0.0, time.time() - self.created),
            "pack_seconds": self.pack_seconds,
            "changes": list(self.changes),
            "cold_read": self.cold_read,
            "predicted_read_s": self.predicted_read_s,
            "predicted_pack_s": self.predicted_pack_s,
            "read_bytes_per_s": self.read_bytes_per_s,
        }


def _repack(path: Path, reason: str, detail: str, **kw: Any) -> Verdict:
    return Verdict(REPACK, reason, detail, str(path), **kw)


def _change_text(change: Change) -> str:
    """One changed key component; for objects (a shard's size and mtime) only what differs."""
    old, new = change.old, change.new
    if isinstance(old, dict) and isinstance(new, dict):
        parts = [
            f"{k} {old.get(k)} → {new.get(k)}"
            for k in sorted({*old, *new})
            if old.get(k) != new.get(k)
        ]
        return f"{change.component} ({', '.join(parts)})"
    return str(change)


def _names_detail(missing: set[str], extra: set[str]) -> str:
    def some(names: set[str]) -> str:
        shown = sorted(names)[:3]
        return ", ".join(shown) + (f", … ({len(names) - 3} more)" if len(names) > 3 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing ({some(missing)})")
    if extra:
        parts.append(f"{len(extra)} extra ({some(extra)})")
    return "tensor names differ from the plan: " + "; ".join(parts)


def _sound_header(fd: int, size: int) -> tuple[Header, Key, float, float]:
    """The header, stored key, creation time and pack seconds, or CorruptSidecar."""
    try:
        header = read_header(fd, size)
    except OSError as e:
        raise CorruptSidecar(f"read error ({e.strerror})") from None
    # The writer places every tensor by one rule (`_layout`: by element size, then header
    # order). Any other placement is corruption that every other check would pass, such as two
    # same-shape tensors with swapped offsets, which would serve each other's bytes.
    try:
        canonical, _ = _layout([TensorPlan(e.name, e.dtype, e.shape) for e in header.entries])
    except ValueError as e:
        raise CorruptSidecar(str(e)) from None
    for e in header.entries:
        want = canonical[e.name]["data_offsets"]
        got = [e.begin - header.data_start, e.end - header.data_start]
        if got != want:
            raise CorruptSidecar(f"tensor '{e.name}' is at data offsets {got}, the writer puts it at {want}")
    meta = header.metadata
    absent = [k for k in REQUIRED_METADATA if k not in meta]
    if absent:
        raise CorruptSidecar(f"metadata lacks {', '.join(absent)}")
    try:
        stored = _key_from_metadata(meta)
    except (ValueError, RecursionError) as e:
        raise CorruptSidecar(f"metadata source_key is unreadable ({e})"[:200]) from None
    if fingerprint(stored) != meta["source_fingerprint"]:
        raise CorruptSidecar("metadata source_fingerprint is not the fingerprint of source_key")
    try:
        return header, stored, float(meta["created"]), float(meta["pack_seconds"])
    except ValueError:
        raise CorruptSidecar("metadata created/pack_seconds are not numbers") from None


def _judge(
    fd: int,
    path: Path,
    *,
    expected_key: Key | None,
    expected_names: set[str] | None,
    cold_threshold: float,
    cold_policy: str,
    residency_method: str | None,
) -> tuple[Verdict, Header | None]:
    """The verdict on the open file `fd` and its header (when sound). Never raises for
    anything the file contains. Checks run cheapest and most decisive first."""
    size = os.fstat(fd).st_size
    facts: dict[str, Any] = {"size_bytes": size}
    # Probed before the header read pulls its first pages in, and reported with every verdict.
    try:
        res: pagecache.Residency | None = pagecache.residency(fd, method=residency_method)
        facts.update(residency=res.fraction, residency_method=res.method)
    except OSError as e:
        log.debug("residency probe of %s failed: %s", path, e)
        res = None
    try:
        header, stored, created, pack_seconds = _sound_header(fd, size)
    except CorruptSidecar as e:
        return _repack(path, "corrupt", str(e), **facts), None
    facts.update(tensors=len(header.entries), created=created, pack_seconds=pack_seconds)

    if expected_key is None:
        try:
            expected_key = _recompute_key(stored, header.metadata, path)
        except UserError as e:
            return _repack(path, "stale", f"source checkpoint unreadable: {e}", **facts), header
    if fingerprint(expected_key) != header.metadata["source_fingerprint"]:
        changes = tuple(_change_text(c) for c in diff(stored, expected_key))
        detail = "changed: " + "; ".join(changes)
        return _repack(path, "stale", detail, changes=changes, **facts), header
    if expected_names is not None:
        missing, extra = set(expected_names) - header.names, header.names - set(expected_names)
        if missing or extra:
            return _repack(path, "names", _names_detail(missing, extra), **facts), header
    return _residency_verdict(path, res, cold_threshold, cold_policy, facts), header


def _residency_verdict(
    path: Path,
    res: pagecache.Residency | None,
    cold_threshold: float,
    cold_policy: str,
    facts: dict[str, Any],
) -> Verdict:
    """A sound, current sidecar: MAP when hot; when cold, what the cold policy says."""
    if res is None:
        return Verdict(MAP, "", "valid; residency unknown", str(path), **facts)
    pct = f"{res.fraction:.0%} resident"
    if res.fraction >= cold_threshold:
        return Verdict(MAP, "", f"valid and hot ({pct})", str(path), **facts)
    below = f"{pct} < {cold_threshold:.0%} threshold"
    if cold_policy == "reject":
        return _repack(path, "cold", f"{below}; cold policy reject", **facts)
    if cold_policy == "read":
        detail = f"{below}; cold policy read: mapping and reading it"
        return Verdict(MAP, "", detail, str(path), cold_read=True, **facts)
    tp = pagecache.read_throughput()
    pack_s = facts["pack_seconds"]
    cold_bytes = max(0, facts["size_bytes"] - res.cached_bytes)
    read_s = cold_bytes / tp.bytes_per_s
    source = "measured on this host" if tp.measured else "default; `dsv4 sidecar warm` measures"
    why = (
        f"reading {format_size(cold_bytes)} at {format_size(tp.bytes_per_s)}/s ({source}) "
        f"≈ {read_s:.1f} s vs repacking ≈ {pack_s:.1f} s"
    )
    facts = {**facts, "predicted_read_s": read_s, "predicted_pack_s": pack_s}
    facts["read_bytes_per_s"] = tp.bytes_per_s
    if read_s <= pack_s:
        detail = f"{below}; cold policy auto reads it: {why}"
        return Verdict(MAP, "", detail, str(path), cold_read=True, **facts)
    return _repack(path, "cold", f"{below}; cold policy auto repacks: {why}", **facts)


def _open(path: Path) -> int | Verdict:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return _repack(path, "missing", "no sidecar at this path; prepack to create it")
    except OSError as e:
        return _repack(path, "corrupt", f"cannot open ({e.strerror}); check its permissions")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return _repack(path, "corrupt", "not a regular file")
    return fd


def _check_args(cold_threshold: float, cold_policy: str) -> None:
    if cold_policy not in COLD_POLICIES:
        raise ValueError(f"cold_policy must be one of {COLD_POLICIES}, got {cold_policy!r}")
    if not 0.0 <= cold_threshold <= 1.0:
        raise ValueError(f"cold_threshold must be within 0..1, got {cold_threshold}")


def inspect(
    path: Path | str,
    *,
    expected_key: Key | None = None,
    expected_names: set[str] | None = None,
    cold_threshold: float = DEFAULT_COLD_THRESHOLD,
    cold_policy: str = "auto",
    residency_method: str | None = None,
) -> Verdict:
    """The verdict on a sidecar without mapping it (no torch). Logged at debug level only:
    this is a query; the loading path (`open_sidecar`) is what logs decisions.

    `expected_key=None` judges staleness against the checkpoint the sidecar records.
    """
    _check_args(cold_threshold, cold_policy)
    path = Path(path)
    opened = _open(path)
    if isinstance(opened, Verdict):
        return opened
    try:
        verdict, _ = _judge(
            opened, path, expected_key=expected_key, expected_names=expected_names,
            cold_threshold=cold_threshold, cold_policy=cold_policy,
            residency_method=residency_method,
        )  # fmt: skip
    finally:
        os.close(opened)
    log.debug("%s", verdict.line())
    return verdict


class MappedSidecar:
    """Zero-copy, read-only tensor views over one MAP_SHARED/PROT_READ mapping of a sidecar."""

    def __init__(self, path: Path, verdict: Verdict, metadata: dict[str, str], mm: mmap.mmap,
                 tensors: dict[str, torch.Tensor]) -> None:  # fmt: skip
        self.path = path
        self.verdict = verdict
        self.metadata = metadata
        self.tensors = tensors
        self._mm: mmap.mmap | None = mm

    def close(self) -> None:
        """Drop our views and unmap. Views the caller still holds keep the mapping alive
        until they are released (the pages stay valid; nothing dangles)."""
        self.tensors = {}
        mm, self._mm = self._mm, None
        if mm is not None:
            # Views still held elsewhere keep the mapping; it goes when the last one does.
            with contextlib.suppress(BufferError):
                mm.close()

    def __enter__(self) -> MappedSidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_sidecar(
    path: Path | str,
    *,
    expected_key: Key | None = None,
    expected_names: set[str] | None = None,
    cold_threshold: float = DEFAULT_COLD_THRESHOLD,
    cold_policy: str = "auto",
    residency_method: str | None = None,
) -> tuple[Verdict, MappedSidecar | None]:
    """Judge and, on MAP, map a sidecar — all through one file descriptor.

    Logs one line for every verdict (REPACK at warning level) and never raises for anything
    wrong with the file: every such case is a REPACK with a reason.
    """
    _check_args(cold_threshold, cold_policy)
    path = Path(path)
    opened = _open(path)
    if isinstance(opened, Verdict):
        log.warning("%s", opened.line())
        return opened, None
    fd = opened
    try:
        verdict, header = _judge(
            fd, path, expected_key=expected_key, expected_names=expected_names,
            cold_threshold=cold_threshold, cold_policy=cold_policy,
            residency_method=residency_method,
        )  # fmt: skip
        if verdict.action != MAP or header is None:
            log.warning("%s", verdict.line())
            return verdict, None
        try:
            mm = mmap.mmap(fd, verdict.size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            verdict = _repack(path, "corrupt", f"cannot map ({e})", size_bytes=verdict.size_bytes)
            log.warning("%s", verdict.line())
            return verdict, None
    finally:
        os.close(fd)  # the mapping holds the inode; the path may be replaced from here on
    if verdict.cold_read and hasattr(mmap, "MADV_WILLNEED"):
        mm.madvise(mmap.MADV_WILLNEED)  # start the read now rather than fault by fault
    tensors = _views(mm, header)
    log.info("%s", verdict.line())
    return verdict, MappedSidecar(path, verdict, dict(header.metadata), mm, tensors)


def _views(mm: mmap.mmap, header: Header) -> dict[str, torch.Tensor]:
    import torch

    dtypes = _torch_dtypes()
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # PROT_READ buffers are not writable; torch warns once. Read-only is the point.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for e in header.entries:
            dtype = dtypes[e.dtype]
            count = (e.end - e.begin) // DTYPE_SIZES[e.dtype]
            if count == 0:
                out[e.name] = torch.empty(e.shape, dtype=dtype)
                continue
            flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=e.begin)
            out[e.name] = flat.view(e.shape)
    return out
