"""Reading an entry: fully verified (every artifact hashed) or by structure only (for plans).

Everything is read through one directory fd, capped (manifests at MAX_MANIFEST_BYTES,
artifacts at the size their manifest records, checked before hashing) and never blocking on a
special file (store.safeio).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from store import safeio
from store.fingerprint import Key, fingerprint, sha256_hex
from store.kernel_cache.entry import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Corrupt,
    Hit,
    Manifest,
    Miss,
    Untrusted,
    check_program_name,
)  # fmt: skip
from store.kernel_cache.inventory import artifact_sizes
from store.kernel_cache.trust import check_entry_path, open_trusted, ownership_problem

if TYPE_CHECKING:
    from store.kernel_cache.cache import KernelCache


def verified(cache: KernelCache, entry: Path, program: str, fp: str) -> tuple[Manifest, dict[str, bytes]]:
    """Manifest and verified contents of one entry, all read through one directory fd: an
    entry replaced meanwhile (purge + republish) can never mix one writer's manifest with
    another's artifact. A Corrupt raised here carries `.dir_id`, the (dev, ino) of the dir
    actually read, so only that dir is quarantined. Sizes are checked before hashing."""
    check_entry_path(cache.root, entry)
    try:
        dfd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise Corrupt(f"{entry.name} is not a directory") from None
    st = os.fstat(dfd)
    try:
        problem = ownership_problem(st)
        if problem:
            raise Untrusted(f"{entry.name} is {problem}")
        manifest = Manifest.parse(cache._read(entry, dfd, MANIFEST, MAX_MANIFEST_BYTES), program, fp)
        contents = {}
        for f in manifest.files:
            data = cache._read(entry, dfd, f.name, f.size)
            if len(data) != f.size:
                raise Corrupt(f"{f.name} has {len(data)} bytes, manifest says {f.size}")
            if sha256_hex(data) != f.sha256:
                raise Corrupt(f"{f.name} does not match its sha256")
            contents[f.name] = data
        return manifest, contents
    except Corrupt as e:
        e.dir_id = (st.st_dev, st.st_ino)
        raise
    finally:
        os.close(dfd)


def capped(root: Path, entry: Path, dfd: int, name: str, cap: int) -> bytes:
    """A file of the entry, never more than `cap` bytes (the manifest's size, or its cap)."""
    try:
        fd = open_trusted(root, entry, dfd, name)
        try:
            size = os.fstat(fd).st_size
            if size > cap and name == MANIFEST:
                raise Corrupt(f"{name} is {size} bytes, over the {cap}-byte limit")
            if size > cap:  # checked before a byte is hashed
                raise Corrupt(f"{name} has {size} bytes, manifest says {cap}")
            return safeio.read_fd(fd, cap, name)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise Corrupt(f"{name} is missing") from None
    except safeio.NotRegularFile as e:
        raise Corrupt(f"{name} is {e.strerror}") from None
    except OSError as e:
        raise Corrupt(f"cannot read {name}: {e.strerror}") from None


def structure(cache: KernelCache, program: str, key: Key) -> Hit | Miss:
    """`probe(verify=False)`: trust, manifest and artifact presence/kind/size; no artifact read."""
    check_program_name(program)
    fp = fingerprint(key)
    if not key.storable:
        return Miss(program, fp, "unknown", f"key has unknown components ({', '.join(key.unknown_components())})")
    cache.check_trust(program)
    entry = cache.base / program / fp
    if not os.path.lexists(entry):
        return cache._closest_miss(program, key, fp)
    try:
        check_entry_path(cache.root, entry)
        raw = safeio.read_regular(entry / MANIFEST, MAX_MANIFEST_BYTES)
        manifest = Manifest.parse(raw, program, fp)
        artifact_sizes(str(entry), manifest)
    except FileNotFoundError:
        return cache._closest_miss(program, key, fp)
    except Corrupt as e:
        kind = "untrusted" if isinstance(e, Untrusted) else "corrupt"
        return Miss(program, fp, kind, f"{kind}: {e}")
    except OSError as e:
        return Miss(program, fp, "corrupt", f"corrupt: cannot read {MANIFEST}: {e.strerror}")
    return Hit(program, fp, entry, manifest, {})
