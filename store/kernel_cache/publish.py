"""Publication: the compile lock, the per-writer staging dir, sealing, and the one rename.

A writer fills a private staging dir, hashes, chmods and fsyncs it, writes the manifest, and
renames the whole dir into its slot: the rename is the only commit point, so readers never mix
one writer's artifact with another's manifest. If the slot exists already another writer won:
ours is discarded and the caller (KernelCache) looks theirs up. The `filelock` lock per
(program, fingerprint) lets a second process wait for the first one's compile and then HIT;
correctness never depends on it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from store.atomic import STAGING_PREFIX, fsync_dir, shared_mode
from store.fingerprint import Key, fingerprint, sha256_hex
from store.kernel_cache.entry import (
    LOCKS,
    MANIFEST,
    ArtifactFile,
    Hit,
    Manifest,
    check_program_name,
    is_artifact_name,
)
from store.kernel_cache.layout import Layout, rand
from store.kernel_cache.trust import (
    UntrustedCacheError,
    check_trust,
    dir_mode,
    ensure_dir,
    marker_problem,
    write_marker,
)

# Errors of the cache's filesystem (full, read-only, not ours to write): the program still
# runs, unpublished, with one warning.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
# Below this much free space on the cache filesystem a compile is not published.
MIN_FREE_BYTES = 256 << 20


def free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def ensure_layout(layout: Layout, program: str) -> None:
    """Create root, v1, locks and the program dir as needed; a new (or empty) root is marked
    before anything else is put in it."""
    check_program_name(program)
    problem = marker_problem(layout.root)
    if problem:
        raise UntrustedCacheError(problem)
    layout.root.parent.mkdir(parents=True, exist_ok=True)
    ensure_dir(layout.root)
    write_marker(layout.root)
    for d in (layout.base, layout.base / LOCKS, layout.base / program):
        ensure_dir(d)
    check_trust(layout, program)


@contextlib.contextmanager
def compile_lock(layout: Layout, program: str, fp: str) -> Iterator[None]:
    from filelock import FileLock, Timeout

    lock = FileLock(layout.lock(program, fp), timeout=layout.lock_timeout, mode=0o644)
    try:
        lock.acquire()
    except (Timeout, OSError):
        yield  # publication stays correct without the lock; we may merely compile twice
        return
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def staging(layout: Layout, program: str, fp: str) -> Iterator[Path]:
    name = f"{STAGING_PREFIX}{fp[:16]}.{socket.gethostname()}.{os.getpid()}.{rand()}"
    path = layout.base / program / name
    path.mkdir(mode=0o700)  # private while filling; opened up by seal
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)  # no-op once renamed into place


def _finish_file(layout: Layout, path: Path) -> None:
    if layout.durable:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    os.chmod(path, shared_mode())


def seal(layout: Layout, staged: Path, program: str, key: Key, config: Collection[str], seconds: float) -> Hit:
    """Hash, chmod and fsync the staged files and write the manifest; the Hit to return."""
    contents, files = {}, []
    for p in sorted(staged.iterdir()):
        if not p.is_file() or p.is_symlink() or not is_artifact_name(p.name):
            raise ValueError(f"a build may only write plain artifact files, found {p.name!r}")
        data = p.read_bytes()
        contents[p.name] = data
        files.append(ArtifactFile(p.name, sha256_hex(data), len(data)))
        _finish_file(layout, p)
    if not files:
        raise ValueError(f"build of {program} wrote no artifact file")
    config = set(config)
    manifest = Manifest(
        program=program,
        fingerprint=fingerprint(key),
        key=key,
        config_components=tuple(n for n, _ in key.components if n in config),
        files=tuple(files),
        compile_seconds=round(seconds, 3),
        created=time.time(),
        host=socket.gethostname(),
        pid=os.getpid(),
        compile_peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
    )
    _write_manifest(layout, staged, manifest)
    return Hit(program, manifest.fingerprint, None, manifest, contents)


def _write_manifest(layout: Layout, staged: Path, manifest: Manifest) -> None:
    """The last step of sealing: the manifest, then the dir opened up and synced."""
    path = staged / MANIFEST
    path.write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True))
    _finish_file(layout, path)
    os.chmod(staged, dir_mode())
    if layout.durable:
        fsync_dir(staged)


def place(layout: Layout, entries: Sequence[tuple[Manifest, Mapping[str, bytes]]]) -> list[Hit | None]:
    """Publish entries built elsewhere, each manifest kept as it is (its producer host and pid,
    its origin), as a local build is: staged and synced, then renamed into its slot. Every
    entry is staged before any is renamed, so a failure while writing (a full disk, a read-only
    root: OSError) places none of them. Per entry, the Hit in place, or None when an entry
    already holds its slot (nothing is replaced)."""
    with contextlib.ExitStack() as stack:  # each staging dir removed on the way out unless renamed
        staged = []
        for manifest, contents in entries:
            ensure_layout(layout, manifest.program)
            path = stack.enter_context(staging(layout, manifest.program, manifest.fingerprint))
            for f in manifest.files:
                (path / f.name).write_bytes(contents[f.name])
                _finish_file(layout, path / f.name)
            _write_manifest(layout, path, manifest)
            staged.append((path, Hit(manifest.program, manifest.fingerprint, None, manifest, dict(contents))))
        out = []
        for path, ours in staged:
            placed = install(layout, path, ours)
            out.append(placed if placed is None or placed.path is not None else None)
        return out


def install(layout: Layout, staged: Path, ours: Hit) -> Hit | None:
    """Rename the sealed staging dir into its slot: the published Hit, `ours` unpublished if
    the staging dir was swept meanwhile, or None when another writer's entry holds the slot
    (ours is discarded; the caller looks theirs up)."""
    final = layout.entry(ours.program, ours.fingerprint)
    try:
        os.rename(staged, final)
    except FileNotFoundError:  # our staging dir was swept from under us: stay unpublished
        return ours
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        return None
    if layout.durable:
        fsync_dir(final.parent)
    return replace(ours, path=final)


def build_private(
    layout: Layout, program: str, key: Key, build: Callable[[Path], None], config: Collection[str]
) -> Hit:
    """Build into a private temp dir and seal it without publishing (unstorable, or no room)."""
    with tempfile.TemporaryDirectory(prefix="dsv4-program-") as tmp:
        started = time.perf_counter()
        build(Path(tmp))
        return seal(layout, Path(tmp), program, key, config, time.perf_counter() - started)
