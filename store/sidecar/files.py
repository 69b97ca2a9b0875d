"""The files around a sidecar: where one may be written, and crashed writers' leftovers.

A sidecar is written only to a regular file or a new path, never over one of the checkpoint's
own files (a --out typo must not replace a shard, nor a device file as root). Staging files of
writers that crashed are swept from the directory before the next write.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from pathlib import Path

from store import atomic, safeio
from store.checkpoint import CONFIG_NAME, INDEX_NAME
from store.errors import UserError
from store.sidecar.key import key_from_metadata

log = logging.getLogger("store.sidecar")

# A staging file older than this whose writer cannot be seen alive is a crash leftover.
STALE_TEMP_SECONDS = 15 * 60


def _checkpoint_files(metadata: dict[str, str]) -> list[Path]:
    """The files of the checkpoint a sidecar is packed from: config, index and every shard."""
    source = Path(metadata.get("source_dir", ""))
    if not metadata.get("source_dir"):
        return []
    shards = [n.removeprefix("shard:") for n, _ in key_from_metadata(metadata).components
              if n.startswith("shard:")]  # fmt: skip
    return [source / CONFIG_NAME, source / INDEX_NAME, *(source / s for s in shards)]


def check_target(path: Path, metadata: dict[str, str]) -> None:
    """A sidecar is written only to a regular file or a new path, and never over one of its
    own checkpoint's files (a --out typo must not replace a shard, nor a device file as root)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path}: is {safeio.kind(st.st_mode)}; write the sidecar to a regular file or a new path")
    target = os.path.realpath(path)
    for own in _checkpoint_files(metadata):
        same = os.path.realpath(own) == target
        if st is not None and not same:
            with contextlib.suppress(OSError):
                same = os.path.samestat(st, os.stat(own))
        if same:
            raise UserError(f"{path}: is the checkpoint's own {own.name}; write the sidecar elsewhere")


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

