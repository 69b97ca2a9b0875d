"""Reading entries: fully verified (every artifact hashed), by structure only (for plans), and
the listing of a program's entries and manifests that a MISS is judged against.

Everything is read through one directory fd, capped (manifests at MAX_MANIFEST_BYTES,
artifacts at the size their manifest records, checked before hashing) and never blocking on a
special file (store.safeio).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

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
    closest_miss,
)  # fmt: skip
from store.kernel_cache.layout import Layout
from store.kernel_cache.trust import (
    check_entry_path,
    check_trust,
    open_trusted,
    ownership_problem,
    real_dirs,
)

# (entry, dir fd, name, cap) -> the file's bytes: `capped`, or the cache's own reader of it
ReadFile = Callable[[Path, int, str, int], bytes]


def verified(
    layout: Layout, entry: Path, program: str, fp: str, read_file: ReadFile, hashed: Callable[[int], None]
) -> tuple[Manifest, dict[str, bytes]]:
    """Manifest and verified contents of one entry, all read through one directory fd: an
    entry replaced meanwhile (purge + republish) can never mix one writer's manifest with
    another's artifact. A Corrupt raised here carries `.dir_id`, the (dev, ino) of the dir
    actually read, so only that dir is quarantined. Sizes are checked before hashing;
    `hashed(n)` is told the size of every artifact hashed, whether it then matched or not."""
    check_entry_path(layout.root, entry)
    try:
        dfd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise Corrupt(f"{entry.name} is not a directory") from None
    st = os.fstat(dfd)
    try:
        problem = ownership_problem(st)
        if problem:
            raise Untrusted(f"{entry.name} is {problem}")
        manifest = Manifest.parse(read_file(entry, dfd, MANIFEST, MAX_MANIFEST_BYTES), program, fp)
        contents = {}
        for f in manifest.files:
            data = read_file(entry, dfd, f.name, f.size)
            if len(data) != f.size:
                raise Corrupt(f"{f.name} has {len(data)} bytes, manifest says {f.size}")
            digest = sha256_hex(data)
            hashed(len(data))
            if digest != f.sha256:
                raise Corrupt(f"{f.name} does not match its sha256")
            contents[f.name] = data
        return manifest, contents
    except Corrupt as e:
        if _moved_or_removed(entry, dfd, st):
            # purged (renamed into the trash and emptied) or replaced while we read it: what
            # looked corrupt was the removal, not this entry; and its inode number may already
            # belong to the entry republished at the path, so nothing may be quarantined by it
            raise FileNotFoundError(f"{entry} was removed while being read") from e
        e.dir_id = (st.st_dev, st.st_ino)
        raise
    finally:
        os.close(dfd)


def _moved_or_removed(entry: Path, dfd: int, st: os.stat_result) -> bool:
    """Is the dir open as `dfd` (stat `st`) no longer the entry at its path?"""
    try:
        if os.fstat(dfd).st_nlink == 0:  # removed: its inode number is free for reuse
            return True
        now = os.lstat(entry)
    except FileNotFoundError:
        return True
    return (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino)


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


def slot(layout: Layout, program: str, key: Key) -> Path | Miss:
    """The entry dir `key` would be in, after the checks every lookup makes first (program
    name, a storable key, a trusted root); a MISS when the key is unstorable or nothing is
    there. The entry's fingerprint is the dir's name."""
    check_program_name(program)
    fp = fingerprint(key)
    if not key.storable:
        unknown = ", ".join(key.unknown_components())
        return Miss(program, fp, "unknown", f"key has unknown components ({unknown}): never cached")
    check_trust(layout, program)
    entry = layout.entry(program, fp)
    if not os.path.lexists(entry):
        return absent(layout, program, key, fp)
    return entry


def absent(layout: Layout, program: str, key: Key, fp: str) -> Miss:
    """The MISS of a key (fingerprint `fp`) whose slot is empty, judged against the program's
    other entries."""
    return closest_miss(program, key, fp, manifests(layout, program))


def structure(layout: Layout, program: str, key: Key) -> Hit | Miss:
    """`probe(verify=False)`: trust, manifest and artifact presence/kind/size; no artifact read."""
    entry = slot(layout, program, key)
    if isinstance(entry, Miss):
        return entry
    fp = entry.name
    try:
        check_entry_path(layout.root, entry)
        raw = safeio.read_regular(entry / MANIFEST, MAX_MANIFEST_BYTES)
        manifest = Manifest.parse(raw, program, fp)
        artifact_sizes(str(entry), manifest)
    except FileNotFoundError:  # purged or quarantined by another process meanwhile
        return absent(layout, program, key, fp)
    except Corrupt as e:
        return Miss(program, fp, e.kind, f"{e.kind}: {e}")
    except OSError as e:
        return Miss(program, fp, "corrupt", f"corrupt: cannot read {MANIFEST}: {e.strerror}")
    return Hit(program, fp, entry, manifest, {})


def artifact_sizes(entry: str, manifest: Manifest) -> int:
    """Total size of the entry's artifacts, each checked present, regular and of its manifest
    size (nothing is read); Corrupt at the first that is not."""
    total = 0
    for f in manifest.files:
        try:
            st = os.lstat(os.path.join(entry, f.name))
        except FileNotFoundError:
            raise Corrupt(f"{f.name} is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise Corrupt(f"{f.name} is {safeio.kind(st.st_mode)}, not an artifact file")
        if st.st_size != f.size:
            raise Corrupt(f"{f.name} has {st.st_size} bytes, manifest says {f.size}")
        total += st.st_size
    return total


def entry_dirs(layout: Layout, program: str) -> Iterator[tuple[str, Path]]:
    """(fingerprint, dir) of every entry of `program` (staging dirs and symlinks excluded)."""
    for d in real_dirs(layout.base / program):
        yield d.name, Path(d.path)


def manifests(layout: Layout, program: str) -> Iterator[Manifest]:
    """Every readable manifest of `program` (unverified: for history, never for loading)."""
    for fp, entry in entry_dirs(layout, program):
        with contextlib.suppress(OSError, Corrupt):
            yield Manifest.parse(safeio.read_regular(entry / MANIFEST, MAX_MANIFEST_BYTES), program, fp)
