"""Checkpoint directories (config.json, model.safetensors.index.json, shards), read lazily.

Opening reads only JSON and shard headers, with every offset checked against the file size,
so listing names, dtypes and shapes never touches tensor data. Tensors are read one at a time
through one handle per shard, reused. torch is imported only by `read`.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from store import safeio
from store.errors import UserError

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# Bytes per element of the byte-addressable safetensors dtypes (sub-byte F4/F6 are not used:
# FP4 experts travel as I8 pairs). Shared by the checkpoint reader and the sidecar format.
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
# The safetensors library's own header limit; larger is hostile or broken. A V4-Flash header
# (~70k tensors) is a few MiB.
MAX_HEADER_BYTES = 100 << 20
# config.json and the index are small; a bigger file there is not one of them (never read whole).
MAX_JSON_BYTES = 64 << 20


class CheckpointError(UserError):
    """The checkpoint directory or one of its files is missing or malformed."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    offsets: tuple[int, int]  # within the shard's data section

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


@dataclass(frozen=True)
class TensorSpec:
    """What the model contract expects of one tensor."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def family(name: str) -> str:
    """Tensor family: layer and expert indices folded, e.g. layers.N.ffn.experts.E.w1.weight."""
    name = re.sub(r"^layers\.\d+\.", "layers.N.", name)
    name = re.sub(r"^mtp\.\d+\.", "mtp.N.", name)
    return re.sub(r"\.experts\.\d+\.", ".experts.E.", name)


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int


def parse_header(path: Path, shard: str | None = None) -> SafetensorsHeader:
    """Read and sanity-check one safetensors header; any flaw is a CheckpointError."""
    shard = shard or path.name
    try:
        # Regular files only, opened without blocking: a FIFO or device here must not hang us.
        with open(safeio.open_regular(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated (no safetensors header); re-download or regenerate the shard")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt safetensors header (length {n} for a {size}-byte file)")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read shard ({e.strerror})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    data_len = size - 8 - n
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (a, b) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
            expected = DTYPE_SIZES[dtype]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for '{name}'") from None
        for d in shape:
            expected *= d
        if not (0 <= a <= b <= data_len) or b - a != expected:
            raise CheckpointError(
                f"{path}: tensor '{name}' has offsets [{a}, {b}) outside the {data_len}-byte data "
                f"section or not matching {dtype}{list(shape)}; the shard is truncated or corrupt"
            )
        tensors[name] = TensorInfo(name, dtype, shape, shard, (a, b))
    return SafetensorsHeader(tensors, metadata, 8 + n)


def _read_json(path: Path, what: str) -> Any:
    try:
        data = safeio.read_regular(path, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}; is this a DeepSeek V4 checkpoint directory?") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror})") from None
    return _parse_json(data, path)


def _parse_json(data: bytes, path: Path | str) -> Any:
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: malformed JSON ({e})") from None


@dataclass
class Checkpoint:
    """An opened checkpoint: index and headers parsed, tensor data read on demand."""

    root: Path
    config: dict
    weight_map: dict[str, str]
    tensors: dict[str, TensorInfo]
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, root: str | Path, config: bytes | None = None) -> Checkpoint:
        """`config`: config.json's bytes as the caller read them (else read here)."""
        root = Path(root)
        if not root.is_dir():
            raise CheckpointError(f"{root}: no such checkpoint directory")
        config = _read_json(root / CONFIG_NAME, CONFIG_NAME) if config is None \
            else _parse_json(config, root / CONFIG_NAME)
        index = _read_json(root / INDEX_NAME, INDEX_NAME)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise CheckpointError(f"{root / INDEX_NAME}: 'weight_map' must map tensor names to shard file names")
        tensors: dict[str, TensorInfo] = {}
        for shard in sorted(set(weight_map.values())):
            path = root / shard
            if "/" in shard or shard.startswith(".") or not path.exists():
                raise CheckpointError(f"{path}: shard listed in {INDEX_NAME} is missing")
            header = parse_header(path, shard)
            for name, info in header.tensors.items():
                if weight_map.get(name) == shard:
                    tensors[name] = TensorInfo(info.name, info.dtype, info.shape, shard,
                                               (info.offsets[0], info.offsets[1]))
        for name, shard in weight_map.items():
            if name not in tensors:
                raise CheckpointError(f"{root / shard}: tensor '{name}' is listed in {INDEX_NAME} "
                                      "but absent from the shard")
        return cls(root, config, dict(weight_map), tensors)

    def names(self) -> list[str]:
        return list(self.weight_map)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.root}: no tensor named '{name}' in this checkpoint") from None

    def shard_paths(self) -> list[Path]:
        return [self.root / s for s in sorted(set(self.weight_map.values()))]

    def read(self, name: str):
        """Load one tensor (a torch.Tensor) through its shard's cached handle."""
        from safetensors import safe_open

        info = self.info(name)
        handle = self._handles.get(info.shard)
        if handle is None:
            try:
                os.close(safeio.open_regular(self.root / info.shard))  # never hand it a FIFO
                handle = safe_open(self.root / info.shard, framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{self.root / info.shard}: cannot open shard ({e})") from None
            self._handles[info.shard] = handle
        return handle.get_tensor(name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for t in self.tensors.values():
            out[t.dtype] += t.nbytes
        return dict(sorted(out.items()))


@dataclass(frozen=True)
class Mismatch:
    name: str
    expected: str
    found: str


@dataclass(frozen=True)
class ContractReport:
    missing: tuple[str, ...]
    extra: tuple[str, ...]
    mismatched: tuple[Mismatch, ...]
    checked: int

    @property
    def ok(self) -> bool:
        return not (self.missing or self.extra or self.mismatched)

    def by_family(self) -> dict[str, dict[str, list[str]]]:
        """{family: {"missing"|"extra"|"mismatched": [names]}} for the report."""
        out: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        for n in self.missing:
            out[family(n)]["missing"].append(n)
        for n in self.extra:
            out[family(n)]["extra"].append(n)
        for m in self.mismatched:
            out[family(m.name)]["mismatched"].append(m.name)
        return {f: dict(v) for f, v in sorted(out.items())}

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "checked": self.checked,
            "missing": list(self.missing),
            "extra": list(self.extra),
            "mismatched": [m.name for m in self.mismatched],
            "mismatch_details": [{"name": m.name, "expected": m.expected, "found": m.found} for m in self.mismatched],
            "by_family": self.by_family(),
        }


def _describe(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype}{list(shape)}"


def check_contract(ckpt: Checkpoint, expected: list[TensorSpec]) -> ContractReport:
    """Expected names, dtypes and shapes against what the checkpoint holds."""
    want = {s.name: s for s in expected}
    missing = tuple(n for n in want if n not in ckpt.tensors)
    extra = tuple(n for n in ckpt.tensors if n not in want)
    mismatched = tuple(
        Mismatch(n, _describe(s.dtype, s.shape), _describe(ckpt.tensors[n].dtype, ckpt.tensors[n].shape))
        for n, s in want.items()
        if n in ckpt.tensors and (ckpt.tensors[n].dtype, ckpt.tensors[n].shape) != (s.dtype, s.shape)
    )
    return ContractReport(missing, extra, mismatched, len(want))
