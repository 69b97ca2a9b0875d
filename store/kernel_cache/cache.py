"""The kernel cache's small interface: lookup (and probe), get-or-build, publish, reject.

Every HIT is verified (sha256 of every artifact against the manifest) and carries the very
bytes that were verified (`Hit.data`): loaders load those bytes, never the path, so a file
swapped after verification cannot be loaded. Residual risk: a loader that needs a file (the
AOTInductor loader) writes those bytes to its own private temp file first; someone who can
write as this user can tamper with that file, but such a user can already run code as us.

This is the only module that composes the others; each of them takes the cache's `Layout`.
The class holds what needs its state (the verified-bytes count, the read seam the concurrency
tests replace): lookups, publication, rejection and verification. Everything else takes
`cache.layout` and calls its module: the inventory, gc, removal and staging sweeps
(store.kernel_cache.inventory), trust checks (.trust), quarantine (.quarantine), manifests
(.read), entries that travel (.transfer); a new transport or policy needs no method here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from store.atomic import shared_mode
from store.fingerprint import Key, fingerprint
from store.kernel_cache import inventory as inv
from store.kernel_cache import publish as pub
from store.kernel_cache import read
from store.kernel_cache.entry import (
    HITS,
    Corrupt,
    Fetch,
    Hit,
    Manifest,
    Miss,
    Verification,
    is_artifact_name,
)  # fmt: skip
from store.kernel_cache.layout import LOCK_TIMEOUT, Layout
from store.kernel_cache.quarantine import quarantine

log = logging.getLogger("store.kernel_cache")


class KernelCache:
    """File-backed kernel cache under `root` (see the package docstring for the layout).

    `verified_bytes`: artifact bytes this instance has sha256-hashed in verified reads (every
    lookup, verifying probe and verify), so a launch can say what it hashed: once per artifact
    when hot."""

    def __init__(self, root: Path | str, *, durable: bool = True, lock_timeout: float = LOCK_TIMEOUT):
        # durable=False skips fsync: only for synthetic caches (benchmarks), never for real ones.
        self.layout = Layout(Path(root).expanduser(), durable, lock_timeout)
        self.verified_bytes = 0
        # a launch's loader thread and its background compile thread may share one cache
        self._count_lock = threading.Lock()

    @property
    def root(self) -> Path:
        return self.layout.root

    # -- lookup ----------------------------------------------------------------------------

    def lookup(self, program: str, key: Key) -> Hit | Miss:
        """HIT with verified bytes, or MISS with its reason. Corrupt entries are quarantined."""
        return self._resolve(program, key, record=True)

    def probe(self, program: str, key: Key, *, verify: bool = True) -> Hit | Miss:
        """`lookup` without side effects (no hit recorded, nothing quarantined): for plans.

        verify=False checks structure only (trust, manifest, every artifact's presence, kind
        and size) and reads no artifact: a HIT then has empty contents and a same-size
        corruption is not seen. Cheap enough for a plan; loading always does the full check."""
        if verify:
            return self._resolve(program, key, record=False)
        return read.structure(self.layout, program, key)

    def record_hit(self, hit: Hit) -> None:
        """Count a HIT that `probe` verified and the caller then loaded (what `lookup` counts
        itself): its bytes need no second read. A Hit without a path was never published."""
        if hit.path is not None:
            self._stamp_hit(hit.path)

    def _resolve(self, program: str, key: Key, *, record: bool, _again: bool = True) -> Hit | Miss:
        entry = read.slot(self.layout, program, key)
        if isinstance(entry, Miss):
            return entry
        fp = entry.name
        try:
            manifest, contents = self.read_verified(entry, program, fp)
        except FileNotFoundError:  # purged, quarantined or replaced by another process meanwhile
            # judge what is there now, once (a republished entry is a HIT)
            return self._resolve(program, key, record=record, _again=False) if _again else \
                read.absent(self.layout, program, key, fp)
        except Corrupt as e:
            if not record:
                return Miss(program, fp, e.kind, f"{e.kind}: {e}")
            if quarantine(self.layout, entry, f"{e.kind}: {e}", expect=e.dir_id) is None:
                # replaced (or removed) since we read it: judge what is there now, once
                return self._resolve(program, key, record=record, _again=False) if _again else \
                    Miss(program, fp, "absent", "entry replaced while reading it")
            return Miss(program, fp, e.kind, f"{e.kind}: {e} (entry quarantined)")
        if record:
            self._stamp_hit(entry)
        return Hit(program, fp, entry, manifest, contents)

    def read_verified(self, entry: Path, program: str, fp: str) -> tuple[Manifest, dict[str, bytes]]:
        """Manifest and sha256-verified contents of one entry dir (store.kernel_cache.read);
        the bytes hashed are added to `verified_bytes`."""
        return read.verified(self.layout, entry, program, fp, self._read, self._count_hashed)

    def _read(self, entry: Path, dfd: int, name: str, cap: int) -> bytes:
        # One method every verified read goes through: the seam the concurrency tests replace.
        return read.capped(self.root, entry, dfd, name, cap)

    def _count_hashed(self, size: int) -> None:
        with self._count_lock:
            self.verified_bytes += size

    def _stamp_hit(self, entry: Path) -> None:
        # One appended byte per hit: size = hit count, mtime = last use. O_APPEND writes of one
        # byte never interleave badly, so concurrent hits need no lock and no manifest rewrite.
        with contextlib.suppress(OSError):
            fd = os.open(entry / HITS, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                         | os.O_NONBLOCK, shared_mode())
            try:
                os.write(fd, b".")
            finally:
                os.close(fd)

    # -- publication -----------------------------------------------------------------------

    def get_or_build(
        self,
        program: str,
        key: Key,
        build: Callable[[Path], None],
        *,
        config_components: Collection[str] = (),
    ) -> Fetch:
        """HIT, or build the artifacts once (`build(dir)` writes them into dir) and publish.

        Processes asking for the same key wait on a lock for the first one's build, then HIT.
        An unstorable key (UNKNOWN components) is built and returned but never stored.
        """
        first = self.lookup(program, key)
        if isinstance(first, Hit):
            return Fetch(first, built=False, miss=None)

        def uncached() -> Fetch:
            return Fetch(pub.build_private(self.layout, program, key, build, config_components), True, first)

        if first.kind == "unknown":
            return uncached()
        try:
            pub.ensure_layout(self.layout, program)
        except OSError as e:
            if e.errno not in pub.STORAGE_ERRNOS:
                raise
            log.warning("kernel cache %s is not writable (%s): %s runs uncached", self.root, e.strerror, program)
            return uncached()
        inv.sweep_staging(self.layout, program)
        with pub.compile_lock(self.layout, program, fingerprint(key)):
            again = self.lookup(program, key)
            if isinstance(again, Hit):
                return Fetch(again, built=False, miss=first)
            # A nearly full cache filesystem: build unpublished (torch's archive writer aborts
            # the whole process on ENOSPC instead of raising, so never let it hit a full disk).
            free = pub.free_bytes(self.layout.base / program)
            if free is not None and free < pub.MIN_FREE_BYTES:
                log.warning("kernel cache %s has %d bytes free: %s runs uncached", self.root, free, program)
                return uncached()
            try:
                with pub.staging(self.layout, program, fingerprint(key)) as staging:
                    started = time.perf_counter()
                    build(staging)
                    hit = pub.seal(self.layout, staging, program, key, config_components,
                                   time.perf_counter() - started)  # fmt: skip
                    return Fetch(self._install(staging, hit), built=True, miss=first)
            except OSError as e:
                if e.errno not in pub.STORAGE_ERRNOS:
                    raise
                log.warning("cannot store %s in kernel cache %s (%s): it runs uncached",
                            program, self.root, e.strerror)  # fmt: skip
                return uncached()

    def publish(
        self,
        program: str,
        key: Key,
        files: Mapping[str, bytes | Path],
        *,
        config_components: Collection[str] = (),
        compile_seconds: float = 0.0,
    ) -> Hit:
        """Store artifacts built elsewhere; returns the entry now in place (ours or a winner's)."""
        if not key.storable:
            raise ValueError(f"refusing to store a key with unknown components {key.unknown_components()}")
        pub.ensure_layout(self.layout, program)
        with pub.staging(self.layout, program, fingerprint(key)) as staging:
            for name, content in files.items():
                if not is_artifact_name(name):
                    raise ValueError(f"invalid artifact name {name!r}")
                if isinstance(content, Path):
                    shutil.copyfile(content, staging / name)
                else:
                    (staging / name).write_bytes(content)
            hit = pub.seal(self.layout, staging, program, key, config_components, compile_seconds)
            return self._install(staging, hit)

    def _install(self, staged: Path, ours: Hit) -> Hit:
        """Publish a sealed staging dir; when another writer won the slot, their verified
        entry (ours, unpublished, if theirs does not verify)."""
        placed = pub.install(self.layout, staged, ours)
        if placed is not None:
            return placed
        theirs = self.lookup(ours.program, ours.manifest.key)
        return theirs if isinstance(theirs, Hit) else ours

    def reject(self, hit: Hit, reason: str) -> None:
        """A verified entry failed to load: quarantine it so the next lookup MISSes."""
        if hit.path is not None:
            quarantine(self.layout, hit.path, f"load failed: {reason}")

    # -- inventory ------------------------------------------------------------------------

    def verify(self) -> Verification:
        """Hash every entry (counted in `verified_bytes`); quarantine those that fail."""
        return inv.verify(self.layout, self.read_verified)
