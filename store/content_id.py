"""A checkpoint's identity by content: what two hosts compare to know they hold the same weights.

The sidecar's source key (`store.sidecar.key`) names shards by size and mtime: the right question
for "did this file change under my sidecar", the wrong one across hosts, where byte-identical
copies have other mtimes. Here each shard is named by the sha256 of its bytes, obtained the
cheapest way that is still trustworthy, and the way is recorded (`how`):

- `hub-blob`: the shard is a symlink into a Hugging Face hub cache's `blobs/<sha256>` (LFS files
  are stored under their content's sha256);
- `hub-metadata`: a `huggingface-cli download --local-dir` copy recorded the LFS sha256 as the
  etag in `.cache/huggingface/download/<name>.metadata`, and the file was not modified after
  that record was written (huggingface_hub's own rule, its 1 s slack included);
- `remembered`: computed here before, for this very file (device, inode, size, mtime_ns,
  ctime_ns): ctime cannot be set back by a user, so a rewrite with the mtime restored shows;
- `computed`: read now, sequentially, and remembered for next time;
- `unknown`: only remembered values were allowed (the console's refresh) and none was.

The identity is the sha256 over config.json's sha256, the weight_map and every shard's (name,
size, sha256). Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from store import safeio
from store.atomic import write_bytes_atomic
from store.errors import UserError
from store.fingerprint import sha256_hex

COMPUTED, REMEMBERED, HUB_BLOB, HUB_METADATA, UNKNOWN = "computed", "remembered", "hub-blob", "hub-metadata", "unknown"
READ_BYTES = 16 << 20  # large sequential reads: a shard is GBs, read once
HF_METADATA_DIR = Path(".cache") / "huggingface" / "download"
_SHA256 = re.compile(r"[0-9a-f]{64}")
CACHE_VERSION = 1


@dataclass(frozen=True)
class ShardDigest:
    name: str
    size: int
    sha256: str | None  # None when `how` is unknown
    how: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256, "how": self.how}

    @classmethod
    def from_json(cls, raw: Any) -> ShardDigest:
        return cls(str(raw["name"]), int(raw["size"]), raw.get("sha256"), str(raw.get("how", UNKNOWN)))


@dataclass(frozen=True)
class ContentId:
    """The checkpoint's content identity (None while a shard's digest is unknown) and its parts."""

    identity: str | None
    config_sha256: str
    weight_map_sha256: str
    shards: tuple[ShardDigest, ...]

    def counts(self) -> dict[str, int]:
        return dict(Counter(s.how for s in self.shards))

    def summary(self) -> str:
        """`c53dec17… (46 shards: 44 remembered, 2 computed)`."""
        how = ", ".join(f"{n} {k}" for k, n in sorted(self.counts().items(), key=lambda kv: -kv[1]))
        head = f"{self.identity[:8]}…" if self.identity else "not known yet"
        return f"{head} ({len(self.shards)} shards: {how})"

    def to_json(self) -> dict[str, Any]:
        return {"identity": self.identity, "config_sha256": self.config_sha256,
                "weight_map_sha256": self.weight_map_sha256, "counts": self.counts(),
                "shards": [s.to_json() for s in self.shards]}


def digest_cache_dir() -> Path:
    """Where computed digests are remembered: one small file per shard file, in the state dir."""
    from store.paths import state_dir

    return state_dir() / "content"


def _fresh(st: os.stat_result) -> dict[str, int]:
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def _entry_path(cache: Path, st: os.stat_result) -> Path:
    return cache / f"{st.st_dev}-{st.st_ino}.json"


def _remembered(cache: Path, st: os.stat_result) -> str | None:
    try:
        raw = json.loads(safeio.read_regular(_entry_path(cache, st), 4096))
    except (OSError, ValueError):
        return None  # none yet, or unreadable: compute
    if not isinstance(raw, dict) or raw.get("v") != CACHE_VERSION or raw.get("file") != _fresh(st):
        return None
    sha = raw.get("sha256")
    return sha if isinstance(sha, str) and _SHA256.fullmatch(sha) else None


def _remember(cache: Path, st: os.stat_result, path: Path, sha: str) -> None:
    entry = {"v": CACHE_VERSION, "file": _fresh(st), "sha256": sha, "path": str(path)}
    try:
        cache.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(_entry_path(cache, st), json.dumps(entry, sort_keys=True).encode())
    except OSError:
        pass  # a read-only state dir costs a recomputation next time, never the launch


def _hub_blob(path: Path, st: os.stat_result) -> str | None:
    """A hub cache's snapshot entry is a symlink to `blobs/<sha256>` for LFS files (a 40-hex
    git sha1 for small ones, which is not a content sha256: not trusted)."""
    if not path.is_symlink():
        return None
    target = Path(os.path.realpath(path))
    return target.name if target.parent.name == "blobs" and _SHA256.fullmatch(target.name) else None


def _hub_metadata(model_dir: Path, name: str, st: os.stat_result) -> str | None:
    """The etag a `--local-dir` download recorded (lines: commit hash, etag, timestamp), trusted
    as huggingface_hub's `read_download_metadata` does: only when the file's mtime is not later
    than the record's timestamp (+1 s, mtimes being imprecise)."""
    try:
        lines = safeio.read_regular(model_dir / HF_METADATA_DIR / f"{name}.metadata", 4096).decode().splitlines()
        etag, stamp = lines[1].strip(), float(lines[2].strip())
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None
    return etag if _SHA256.fullmatch(etag) and st.st_mtime - 1 <= stamp else None


def _compute(path: Path) -> tuple[str, os.stat_result]:
    """sha256 of the regular file at `path` and its stat at open; never opens a FIFO or device."""
    try:
        fd = safeio.open_regular(path)
    except safeio.NotRegularFile as e:
        raise UserError(f"{path}: {e.strerror}; a checkpoint shard must be a regular file") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror}); check the file") from None
    try:
        st = os.fstat(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        h, buf = hashlib.sha256(), bytearray(READ_BYTES)
        view = memoryview(buf)
        with open(fd, "rb", buffering=0, closefd=False) as f:
            while n := f.readinto(view):
                h.update(view[:n])
        after = os.fstat(fd)
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror}); check the file") from None
    finally:
        os.close(fd)
    if _fresh(after) != _fresh(st):
        raise UserError(f"{path}: changed while its digest was computed; try again once it is written")
    return h.hexdigest(), st


def shard_digest(model_dir: Path, name: str, *, compute: bool = True, cache: Path | None = None) -> ShardDigest:
    """The content digest of shard `name` of `model_dir`, the cheapest trustworthy way (see the
    module's docstring); `compute=False` never reads a shard's bytes."""
    path = model_dir / name
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{path}: not found; the index names it, so the checkpoint is incomplete") from None
    except OSError as e:
        raise UserError(f"{path}: cannot stat ({e.strerror}); check the file") from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path}: not a regular file ({safeio.kind(st.st_mode)}); a checkpoint shard must be a file")
    if sha := _hub_blob(path, st):
        return ShardDigest(name, st.st_size, sha, HUB_BLOB)
    if sha := _hub_metadata(model_dir, name, st):
        return ShardDigest(name, st.st_size, sha, HUB_METADATA)
    cache = cache or digest_cache_dir()
    if sha := _remembered(cache, st):
        return ShardDigest(name, st.st_size, sha, REMEMBERED)
    if not compute:
        return ShardDigest(name, st.st_size, None, UNKNOWN)
    sha, st = _compute(path)
    _remember(cache, st, path, sha)
    return ShardDigest(name, st.st_size, sha, COMPUTED)


def content_id(model_dir: Path | str, *, compute: bool = True, config: bytes | None = None) -> ContentId:
    """The checkpoint's content identity; UserError (one line) for a broken checkpoint or shard.
    `config`: config.json's bytes as the caller read them (else read here)."""
    from store.sidecar.key import read_index

    model_dir = Path(model_dir)
    config, weight_map = read_index(model_dir, config)
    cache = digest_cache_dir()
    shards = tuple(shard_digest(model_dir, n, compute=compute, cache=cache)
                   for n in sorted(set(map(str, weight_map.values()))))
    config_sha = sha256_hex(config)
    map_sha = sha256_hex(json.dumps(weight_map, sort_keys=True))
    identity = None
    if all(s.sha256 for s in shards):
        identity = sha256_hex(json.dumps([config_sha, weight_map, [[s.name, s.size, s.sha256] for s in shards]],
                                         sort_keys=True, separators=(",", ":")))
    return ContentId(identity, config_sha, map_sha, shards)
