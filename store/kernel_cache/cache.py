"""The kernel cache's small interface: lookup (and probe), get-or-build, publish, reject.

Every HIT is verified (sha256 of every artifact against the manifest) and carries the very
bytes that were verified (`Hit.data`): loaders load those bytes, never the path, so a file
swapped after verification cannot be loaded. Residual risk: a loader that needs a file (the
AOTInductor loader) writes those bytes to its own private temp file first; someone who can
write as this user can tamper with that file, but such a user can already run code as us.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path

from store import safeio
from store.atomic import shared_mode
from store.fingerprint import Key, describe, diff, fingerprint
from store.kernel_cache import inventory as inv
from store.kernel_cache import publish as pub
from store.kernel_cache import read
from store.kernel_cache.entry import (
    HITS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    VERSION_DIR,
    Corrupt,
    Entry,
    Fetch,
    Hit,
    Manifest,
    Miss,
    Reference,
    Untrusted,
    Verification,
    build_changes,
    check_program_name,
    is_artifact_name,
)  # fmt: skip
from store.kernel_cache.trust import (
    UntrustedCacheError,
    trust_problem,
)  # fmt: skip

# A compile may take minutes; past this we compile anyway (the lock is an optimisation).
LOCK_TIMEOUT = 1800.0

log = logging.getLogger("store.kernel_cache")


class KernelCache:
    """File-backed kernel cache under `root` (see the package docstring for the layout)."""

    def __init__(self, root: Path | str, *, durable: bool = True, lock_timeout: float = LOCK_TIMEOUT):
        self.root = Path(root).expanduser()
        self.base = self.root / VERSION_DIR
        # durable=False skips fsync: only for synthetic caches (benchmarks), never for real ones.
        self.durable = durable
        self.lock_timeout = lock_timeout

    # -- trust -----------------------------------------------------------------------------

    def trust_problem(self, program: str | None = None) -> str | None:
        """Why using this root (and program dir) is refused, or None when it is fine."""
        return trust_problem(self.root, [self.root, self.base] + ([self.base / program] if program else []))

    def check_trust(self, program: str | None = None) -> None:
        problem = self.trust_problem(program)
        if problem:
            raise UntrustedCacheError(problem)

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
        return read.structure(self, program, key)

    def _resolve(self, program: str, key: Key, *, record: bool, _again: bool = True) -> Hit | Miss:
        check_program_name(program)
        fp = fingerprint(key)
        if not key.storable:
            unknown = ", ".join(key.unknown_components())
            return Miss(program, fp, "unknown", f"key has unknown components ({unknown}): never cached")
        self.check_trust(program)
        entry = self.base / program / fp
        if not os.path.lexists(entry):
            return self._closest_miss(program, key, fp)
        try:
            manifest, contents = self.read_verified(entry, program, fp)
        except FileNotFoundError:  # purged or quarantined by another process meanwhile
            return self._closest_miss(program, key, fp)
        except Corrupt as e:
            kind = "untrusted" if isinstance(e, Untrusted) else "corrupt"
            if not record:
                return Miss(program, fp, kind, f"{kind}: {e}")
            if self.quarantine(entry, f"{kind}: {e}", expect=getattr(e, "dir_id", None)) is None:
                # replaced (or removed) since we read it: judge what is there now, once
                return self._resolve(program, key, record=record, _again=False) if _again else \
                    Miss(program, fp, "absent", "entry replaced while reading it")
            return Miss(program, fp, kind, f"{kind}: {e} (entry quarantined)")
        if record:
            self._stamp_hit(entry)
        return Hit(program, fp, entry, manifest, contents)

    def _closest_miss(self, program: str, key: Key, fp: str) -> Miss:
        best: tuple[int, float, Manifest] | None = None
        for m in self._manifests(program):
            rank = (len(diff(m.key, key)), -m.created)
            if best is None or rank < best[:2]:
                best = (*rank, m)
        if best is None:
            return Miss(program, fp, "absent", "not cached")
        closest = best[2]
        changes = tuple(diff(closest.key, key))
        build = build_changes(changes, closest, key.as_dict())
        kind = "stale" if build else "absent"
        what = "stale" if build else "not cached for this configuration"
        reason = f"{what}: {describe(list(build or changes))} (closest entry {closest.fingerprint[:12]})"
        return Miss(program, fp, kind, reason, changes)

    def manifests(self, program: str) -> Iterator[Manifest]:
        """Every readable manifest of `program` (unverified: for history, never for loading)."""
        return self._manifests(program)

    def _manifests(self, program: str) -> Iterator[Manifest]:
        for fp, entry in inv.entry_dirs(self, program):
            with contextlib.suppress(OSError, Corrupt):
                yield Manifest.parse(safeio.read_regular(entry / MANIFEST, MAX_MANIFEST_BYTES), program, fp)

    def read_verified(self, entry: Path, program: str, fp: str) -> tuple[Manifest, dict[str, bytes]]:
        return read.verified(self, entry, program, fp)

    def _read(self, entry: Path, dfd: int, name: str, cap: int) -> bytes:
        return read.capped(self.root, entry, dfd, name, cap)

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
        if first.kind == "unknown":
            return Fetch(pub.build_private(self, program, key, build, config_components), True, first)
        try:
            pub.ensure_layout(self, program)
        except OSError as e:
            if e.errno not in pub.STORAGE_ERRNOS:
                raise
            log.warning("kernel cache %s is not writable (%s): %s runs uncached", self.root, e.strerror, program)
            return Fetch(pub.build_private(self, program, key, build, config_components), True, first)
        self.sweep_staging(program)
        with pub.compile_lock(self, program, fingerprint(key)):
            again = self.lookup(program, key)
            if isinstance(again, Hit):
                return Fetch(again, built=False, miss=first)
            # A nearly full cache filesystem: build unpublished (torch's archive writer aborts
            # the whole process on ENOSPC instead of raising, so never let it hit a full disk).
            free = pub.free_bytes(self.base / program)
            if free is not None and free < pub.MIN_FREE_BYTES:
                log.warning("kernel cache %s has %d bytes free: %s runs uncached", self.root, free, program)
                return Fetch(pub.build_private(self, program, key, build, config_components), True, first)
            try:
                with pub.staging(self, program, fingerprint(key)) as staging:
                    started = time.perf_counter()
                    build(staging)
                    hit = pub.seal(self, staging, program, key, config_components,
                                   time.perf_counter() - started)  # fmt: skip
                    return Fetch(pub.install(self, staging, hit), built=True, miss=first)
            except OSError as e:
                if e.errno not in pub.STORAGE_ERRNOS:
                    raise
                log.warning("cannot store %s in kernel cache %s (%s): it runs uncached",
                            program, self.root, e.strerror)  # fmt: skip
                return Fetch(pub.build_private(self, program, key, build, config_components), True, first)

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
        pub.ensure_layout(self, program)
        with pub.staging(self, program, fingerprint(key)) as staging:
            for name, content in files.items():
                if not is_artifact_name(name):
                    raise ValueError(f"invalid artifact name {name!r}")
                if isinstance(content, Path):
                    shutil.copyfile(content, staging / name)
                else:
                    (staging / name).write_bytes(content)
            hit = pub.seal(self, staging, program, key, config_components, compile_seconds)
            return pub.install(self, staging, hit)

    def reject(self, hit: Hit, reason: str) -> None:
        """A verified entry failed to load: quarantine it so the next lookup MISSes."""
        if hit.path is not None:
            self.quarantine(hit.path, f"load failed: {reason}")

    # -- inventory and cleanup (store.kernel_cache.inventory) ------------------------------

    def quarantine(self, entry: Path, reason: str, expect: tuple[int, int] | None = None) -> Path | None:
        return inv.quarantine(self, entry, reason, expect)

    def remove(self, entries: Iterable[Entry]) -> list[Entry]:
        return inv.remove(self, entries)

    def sweep_staging(self, program: str) -> list[Entry]:
        return inv.sweep_staging(self, program)

    def empty_trash(self) -> None:
        inv.empty_trash(self)

    def gc(self, max_size: int, reference: Reference | None = None) -> list[Entry]:
        return inv.gc(self, max_size, reference)

    def inventory(self, reference: Reference | None = None) -> list[Entry]:
        return inv.inventory(self, reference)

    def programs(self) -> list[str]:
        return inv.programs(self)

    def verify(self) -> Verification:
        return inv.verify(self)
