"""The sidecar file format: header parsing, soundness, and the one canonical data layout.

A sidecar is a safetensors file (any `safetensors` reader loads it). Tensors are laid out in
layout order *grouped by element size* (8-byte dtypes first), so every zero-copy view is
naturally aligned; the header JSON is padded with spaces so data starts on DATA_ALIGN, and so
the final header (with the measured pack seconds) fits in the space reserved before any tensor
was written. Soundness = a parseable header whose every tensor lies where the writer puts it,
plus the metadata the verdicts need. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any

from store.checkpoint import DTYPE_SIZES, MAX_HEADER_BYTES
from store.fingerprint import Key, fingerprint
from store.sidecar.key import key_from_metadata
from store.units import format_size

DATA_ALIGN = 64
HEADER_SLACK = 64

REQUIRED_METADATA = (
    "format", "packer_version", "source_fingerprint", "source_key", "ranks", "created",
    "pack_seconds",
)  # fmt: skip


@dataclass(frozen=True)
class TensorShape:
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


def encode_header(entries: dict[str, dict], metadata: dict[str, str], size: int | None) -> bytes:
    """The 8-byte length plus JSON padded with spaces to `size` (or to the alignment + slack)."""
    body = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":")).encode()
    if size is None:
        size = len(body) + HEADER_SLACK
        size += -(8 + size) % DATA_ALIGN
    if len(body) > size:
        raise ValueError(f"header grew past its reserved {size} bytes")
    return struct.pack("<Q", size) + body + b" " * (size - len(body))


def layout(shapes: list[TensorShape]) -> tuple[dict[str, dict], list[tuple[TensorShape, int]]]:
    """Header entries (in layout order) and each entry's data offset, size-aligned."""
    names = [p.name for p in shapes]
    if len(names) != len(set(names)):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names: {dup[:5]}")
    if "__metadata__" in names:
        raise ValueError("'__metadata__' is not a tensor name")
    offsets: dict[str, int] = {}
    pos = 0
    for p in sorted(shapes, key=lambda p: -DTYPE_SIZES[p.dtype]):  # stable: layout order kept
        offsets[p.name] = pos
        pos += p.nbytes
    entries = {
        p.name: {
            "dtype": p.dtype,
            "shape": list(p.shape),
            "data_offsets": [offsets[p.name], offsets[p.name] + p.nbytes],
        }
        for p in shapes
    }
    return entries, [(p, offsets[p.name]) for p in shapes]


def pread_exact(fd: int, n: int, offset: int) -> bytes:
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


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_header(fd: int, file_size: int) -> Header:
    """Parse and check a safetensors header from `fd`; CorruptSidecar says what is wrong.

    Nothing is allocated from a size the file claims before that size is checked against the
    file and MAX_HEADER_BYTES, and every tensor's bytes must lie inside the file, agree with its
    dtype and shape, and tile the data region exactly (no overlap, gap or trailing bytes).
    """
    if file_size < 8:
        raise CorruptSidecar(f"truncated: {file_size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", pread_exact(fd, 8, 0))
    if n > MAX_HEADER_BYTES:
        raise CorruptSidecar(f"header length {n} exceeds the {format_size(MAX_HEADER_BYTES)} limit")
    if 8 + n > file_size:
        raise CorruptSidecar(f"header length {n} runs past the end of the file ({file_size} bytes)")
    try:
        raw = json.loads(pread_exact(fd, n, 8).decode("utf-8"), object_pairs_hook=_no_duplicates)
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
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise CorruptSidecar(f"{name}: shape {shape!r} is not a list of non-negative ints")
        if not (isinstance(offs, list) and len(offs) == 2 and all(map(is_int, offs))):
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



def sound_header(fd: int, size: int) -> tuple[Header, Key, float, float]:
    """The header, stored key, creation time and pack seconds, or CorruptSidecar."""
    try:
        header = read_header(fd, size)
    except OSError as e:
        raise CorruptSidecar(f"read error ({e.strerror})") from None
    # The writer places every tensor by one rule (`layout`: by element size, then header
    # order). Any other placement is corruption that every other check would pass, such as two
    # same-shape tensors with swapped offsets, which would serve each other's bytes.
    try:
        canonical, _ = layout([TensorShape(e.name, e.dtype, e.shape) for e in header.entries])
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
        stored = key_from_metadata(meta)
    except (ValueError, RecursionError) as e:
        raise CorruptSidecar(f"metadata source_key is unreadable ({e})"[:200]) from None
    if fingerprint(stored) != meta["source_fingerprint"]:
        raise CorruptSidecar("metadata source_fingerprint is not the fingerprint of source_key")
    try:
        return header, stored, float(meta["created"]), float(meta["pack_seconds"])
    except ValueError:
        raise CorruptSidecar("metadata created/pack_seconds are not numbers") from None

