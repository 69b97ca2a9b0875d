"""Prepacked weight sidecars: one file per (checkpoint, ranks) holding the packed serving layout.

A sidecar is a safetensors file (any `safetensors` reader loads it). The packing rules live in
runtime/weights/pack.py; this package only knows tensor shapes, bytes and keys:

- `name`    the file name (`dsv4-packed.r<ranks>.safetensors`), built, globbed and parsed once
- `key`     the source key (what it was packed from) and the metadata that records it
- `format`  header parsing, soundness and the one canonical data layout
- `writer`  the streaming writer (`checksum`: per-chunk checksums of the data it wrote)
- `files`   where a sidecar may be written; the sweep of crashed writers' staging files
- `verdict` MAP or REPACK and why, with the cold policy (`inspect`: no torch)
- `loader`  judge + map through one fd, zero-copy read-only torch views (`open_sidecar`)
- `watch`   the read lease / fd identity that says when a mapped sidecar changes

    verdict, mapped = open_sidecar(path, expected_key=key, expected_names=names)
    if mapped: use mapped.tensors; mapped.close() when done
    else:      pack from the checkpoint (verdict.reason / verdict.detail say why)

Only `loader` imports torch, inside functions; the console calls `inspect` without torch.
"""

from store.checkpoint import CONFIG_NAME, DTYPE_SIZES, INDEX_NAME
from store.fingerprint import Key, fingerprint
from store.sidecar.files import STALE_TEMP_SECONDS, check_target, sweep_temp_files
from store.sidecar.format import (
    DATA_ALIGN,
    REQUIRED_METADATA,
    CorruptSidecar,
    Header,
    TensorEntry,
    TensorShape,
    read_header,
)
from store.sidecar.key import key_from_metadata, sidecar_metadata, source_key
from store.sidecar.loader import MappedSidecar, open_sidecar
from store.sidecar.name import (
    FILE_PREFIX,
    default_sidecar_path,
    file_name,
    find_sidecars,
    glob_pattern,
    ranks_of,
)
from store.sidecar.verdict import (
    COLD_POLICIES,
    DEFAULT_COLD_THRESHOLD,
    MAP,
    REASONS,
    REPACK,
    Action,
    Reason,
    Verdict,
    inspect,
    missing,
)
from store.sidecar.writer import SidecarInfo, planned_bytes, write_sidecar

__all__ = [
    "COLD_POLICIES",
    "CONFIG_NAME",
    "DATA_ALIGN",
    "DEFAULT_COLD_THRESHOLD",
    "DTYPE_SIZES",
    "FILE_PREFIX",
    "INDEX_NAME",
    "MAP",
    "REASONS",
    "REPACK",
    "REQUIRED_METADATA",
    "STALE_TEMP_SECONDS",
    "Action",
    "CorruptSidecar",
    "Header",
    "Key",
    "MappedSidecar",
    "Reason",
    "SidecarInfo",
    "TensorEntry",
    "TensorShape",
    "Verdict",
    "check_target",
    "default_sidecar_path",
    "file_name",
    "find_sidecars",
    "fingerprint",
    "glob_pattern",
    "inspect",
    "key_from_metadata",
    "missing",
    "open_sidecar",
    "planned_bytes",
    "ranks_of",
    "read_header",
    "sidecar_metadata",
    "source_key",
    "sweep_temp_files",
    "write_sidecar",
]  # fmt: skip
