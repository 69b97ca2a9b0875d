"""The sidecar's source key: what a sidecar was packed from, and whether that changed.

Components: format, packer version, ranks, layout, config.json's sha256, the weight_map's
sha256, then one `shard:<name>` component (size, mtime_ns) per shard, so a stale sidecar
names the very shard that changed. The metadata stores the key and `source_dir` (kept out of
the key so a checkpoint moved together with its sidecar stays valid).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from store import safeio
from store.checkpoint import CONFIG_NAME, INDEX_NAME, MAX_JSON_BYTES
from store.errors import UserError
from store.fingerprint import Change, Key, fingerprint, sha256_hex


def _checkpoint_file(model_dir: Path, name: str) -> bytes:
    path = model_dir / name
    try:
        return safeio.read_regular(path, MAX_JSON_BYTES)
    except FileNotFoundError:
        raise UserError(f"{path}: not found; point at a checkpoint directory") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror}); check the file") from None


def read_index(model_dir: Path, config: bytes | None = None) -> tuple[bytes, dict[str, Any]]:
    """config.json's bytes (`config`: as the caller read them already) and the index's weight_map
    (tensor → shard); one line when broken."""
    config = config if config is not None else _checkpoint_file(model_dir, CONFIG_NAME)
    try:
        weight_map = json.loads(_checkpoint_file(model_dir, INDEX_NAME))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{model_dir / INDEX_NAME}: not a safetensors index ({e})") from None
    return config, weight_map


def source_key(
    model_dir: Path | str, *, format: str, packer_version: str, ranks: int, layout: dict,
    config: bytes | None = None,
) -> Key:
    """The key of the checkpoint a sidecar is packed from. Compute it BEFORE packing starts.
    `config`: config.json's bytes as the caller read them (else read here).

    A shard that is gone reads as "<missing>"; one that is not a regular file as "<not a file>".
    """
    model_dir = Path(model_dir)
    config, weight_map = read_index(model_dir, config)
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
            if not stat.S_ISREG(st.st_mode):
                value = "<not a file>"
        except FileNotFoundError:
            value = "<missing>"
        except OSError:
            value = "<unreadable>"
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


def key_from_metadata(metadata: dict[str, str]) -> Key:
    return Key.from_json(json.loads(metadata["source_key"]))


def recompute_key(stored: Key, metadata: dict[str, str], sidecar: Path) -> Key:
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


def change_text(change: Change) -> str:
    """One changed key component as its sentence; for objects (a shard's size and mtime) only
    what differs (`store.fingerprint.Change`)."""
    return str(change)
