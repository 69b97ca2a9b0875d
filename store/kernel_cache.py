"""Program cache: a fingerprinted, verified, concurrent-safe store of compiled programs.

Layout (format version 1)::

    <root>/v1/<program>/<fingerprint>/        one entry: artifact file(s) + manifest.json
    <root>/v1/<program>/.tmp-<fp>.<host>.<pid>.<rand>/   a writer's staging dir (ignored by readers)
    <root>/v1/<program>/<fingerprint>/.hits   hit stamp: one byte appended per hit
    <root>/v1/.locks/<program>.<fingerprint>.lock        compile lock (filelock)
    <root>/quarantine/<program>--<fp>--<time>--<rand>/  entries that failed to read/verify/load
    <root>/.trash/                            entries being deleted (rename first, delete after)

The manifest records the full key, which of its components describe a *configuration*
(deployment layout, model dims, signature, backend, device kind: `config_components`), the
sha256 and size of every artifact file, compile seconds, creation time and producer host/pid.

Entries are published as one unit: a writer fills a per-writer staging dir, fsyncs it and
renames it into place; if the slot exists already another writer won and ours is discarded.
A `filelock` lock per (program, fingerprint) lets a second process wait for the first one's
compile and then HIT; correctness never depends on it (rename is the only commit point).

Every HIT is verified (sha256 of every artifact against the manifest) and carries the very
bytes that were verified (`Hit.data`): loaders load those bytes, never the path, so a file
swapped after verification cannot be loaded. Residual risk: a loader that needs a file (the
AOTInductor loader) writes those bytes to its own private temp file first; someone who can
write as this user can tamper with that file, but such a user can already run code as us.

Trust: a root, `v1` or program dir that is group/world-writable or owned by another user
makes every load refuse with `UntrustedCacheError` (one line: why and how to fix). An entry
with such files, or with symlinks leading outside the root, is a MISS and is quarantined.

"Current environment" without a live key: this module never imports torch, so it cannot
compute keys. Callers hand it a `Reference`: the live keys of the programs they can build now
(full check), plus the component values they know for every program (typically the toolchain:
torch version, device capability, compiler, env flags; values equal to UNKNOWN are not
compared). An entry is `stale` only when a component present both in it and in the
reference differs and is not a configuration component: such an entry can never HIT again.
Differences in configuration components (or components only one side has) make it
`other-layout`. An entry whose program has no live key and whose known components match is
reported `current` with a reason saying source and layout were not checked: `purge --stale`
only ever deletes entries that are provably unusable.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import shutil
import socket
import stat
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from store.atomic import STAGING_PREFIX, fsync_dir, is_staging, pid_alive, shared_mode
from store.errors import UserError
from store.fingerprint import UNKNOWN, Change, Key, describe, diff, fingerprint, sha256_hex

FORMAT_VERSION = 1
VERSION_DIR = f"v{FORMAT_VERSION}"
MANIFEST = "manifest.json"
HITS = ".hits"
QUARANTINE = "quarantine"
QUARANTINE_NOTE = "quarantine.json"
TRASH = ".trash"
LOCKS = ".locks"
# A staging dir older than this is abandoned (sooner if its writer on this host is gone).
STAGING_MAX_AGE = 3600.0
# A compile may take minutes; past this we compile anyway (the lock is an optimisation).
LOCK_TIMEOUT = 1800.0

CURRENT = "current"
OTHER_LAYOUT = "other-layout"
STALE = "stale"
CORRUPT = "corrupt"
PARTIAL = "partial"
STATES = (CURRENT, OTHER_LAYOUT, STALE, CORRUPT, PARTIAL)

_GROUP_OR_WORLD_WRITE = stat.S_IWGRP | stat.S_IWOTH
# Errors of the cache's filesystem (full, read-only, not ours to write): the program still
# runs, unpublished, with one warning.
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)

# Below this much free space on the cache filesystem a compile is not published.
MIN_FREE_BYTES = 256 << 20

log = logging.getLogger(__name__)


class UntrustedCacheError(UserError):
    """The cache root may contain code written by someone else: refuse to load from it."""


class _Corrupt(Exception):
    """An entry that cannot be read or verified (internal: becomes a MISS + quarantine)."""


class _Untrusted(_Corrupt):
    """An entry whose files could have been written by someone else."""


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True)
class ArtifactFile:
    name: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Manifest:
    program: str
    fingerprint: str
    key: Key
    config_components: tuple[str, ...]
    files: tuple[ArtifactFile, ...]
    compile_seconds: float
    created: float
    host: str
    pid: int
    format: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "program": self.program,
            "fingerprint": self.fingerprint,
            "key": self.key.to_json(),
            "config_components": list(self.config_components),
            "files": [{"name": f.name, "sha256": f.sha256, "size": f.size} for f in self.files],
            "compile_seconds": self.compile_seconds,
            "created": self.created,
            "host": self.host,
            "pid": self.pid,
        }

    @classmethod
    def parse(cls, raw: bytes, program: str, fp: str) -> Manifest:
        """Parse and check a manifest read from `<program>/<fp>/`; raise _Corrupt on any flaw."""
        try:
            data = json.loads(raw)
            if not isinstance(data["program"], str) or not isinstance(data["fingerprint"], str):
                raise TypeError("program and fingerprint must be strings")
            m = cls(
                program=data["program"],
                fingerprint=data["fingerprint"],
                key=_key_from_json(data["key"]),
                config_components=tuple(str(n) for n in data["config_components"]),
                files=tuple(
                    ArtifactFile(str(f["name"]), str(f["sha256"]), int(f["size"]))
                    for f in data["files"]
                ),
                compile_seconds=float(data["compile_seconds"]),
                created=float(data["created"]),
                host=str(data["host"]),
                pid=int(data["pid"]),
                format=int(data["format"]),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise _Corrupt(f"malformed manifest ({type(e).__name__}: {e})") from None
        if m.format != FORMAT_VERSION:
            raise _Corrupt(f"manifest format {m.format}, expected {FORMAT_VERSION}")
        if (m.program, m.fingerprint) != (program, fp):
            raise _Corrupt(f"manifest names {m.program}/{m.fingerprint[:12]}, not its own slot")
        if fingerprint(m.key) != fp:
            raise _Corrupt("manifest key does not hash to the entry's fingerprint")
        bad = [f.name for f in m.files if not _is_artifact_name(f.name)]
        if bad or not m.files:
            raise _Corrupt(f"manifest lists invalid artifact names {bad}")
        return m


def _key_from_json(data: Any) -> Key:
    # Key.from_json re-canonicalises every value through JSON; values parsed from JSON already
    # are canonical, and skipping that halves the time `ls` takes over a large cache.
    if not isinstance(data, list) or not all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in data
    ):
        raise ValueError("key must be a list of [name, value] pairs")
    if len({p[0] for p in data}) != len(data):
        raise ValueError("duplicate key component names")
    return Key(tuple((p[0], p[1]) for p in data))


@dataclass(frozen=True)
class Hit:
    """A verified entry. `data(name)` returns the exact bytes whose sha256 was checked."""

    program: str
    fingerprint: str
    path: Path | None  # None: built by this process but not published (lost a race, unstorable)
    manifest: Manifest
    contents: Mapping[str, bytes] = field(repr=False)
    hit = True

    def data(self, name: str) -> bytes:
        return self.contents[name]


@dataclass(frozen=True)
class Miss:
    """Why a lookup did not hit: kind is absent | stale | corrupt | unknown | untrusted."""

    program: str
    fingerprint: str
    kind: str
    reason: str
    changes: tuple[Change, ...] = ()
    hit = False


@dataclass(frozen=True)
class Fetch:
    """Result of `get_or_build`: the verified entry, whether this call compiled it, first MISS."""

    hit: Hit
    built: bool
    miss: Miss | None


@dataclass(frozen=True)
class Reference:
    """What the caller knows about the current environment (see the module docstring)."""

    components: Mapping[str, Any] = field(default_factory=dict)
    keys: Mapping[str, Key] = field(default_factory=dict)

    @functools.cached_property
    def fingerprints(self) -> dict[str, str]:
        return {program: fingerprint(key) for program, key in self.keys.items()}


@dataclass(frozen=True)
class Entry:
    """One line of the inventory."""

    program: str
    fingerprint: str
    state: str
    reason: str
    size_bytes: int
    created: float
    last_used: float
    hits: int
    path: Path
    busy: bool = False  # a partial entry whose writer may still be running

    def to_json(self) -> dict[str, Any]:
        return {
            "program": self.program,
            "fingerprint": self.fingerprint,
            "state": self.state,
            "reason": self.reason,
            "size_bytes": self.size_bytes,
            "created": self.created,
            "last_used": self.last_used,
            "hits": self.hits,
            "path": str(self.path),
            "busy": self.busy,
        }


@dataclass(frozen=True)
class Verification:
    """Result of `verify`: how many entries were hashed, which were quarantined."""

    checked: int
    quarantined: tuple[Entry, ...]


# ---------------------------------------------------------------------------------------------
# Small helpers


def _is_artifact_name(name: str) -> bool:
    return bool(name) and "/" not in name and not name.startswith(".") and name != MANIFEST


def check_program_name(program: str) -> str:
    if not program or program.startswith(".") or "/" in program or "\0" in program:
        raise ValueError(f"invalid program name {program!r}")
    return program


def _dir_mode() -> int:
    # Never group/world-writable whatever the umask: our own trust check would refuse it.
    return shared_mode(0o755) & ~_GROUP_OR_WORLD_WRITE


def _ensure_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o755)
    except FileExistsError:
        return
    os.chmod(path, _dir_mode())


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_size
    return total


def _rand() -> str:
    return os.urandom(4).hex()


def _writer_alive(host: str, pid: int) -> bool | None:
    """True/False for a writer on this host; None when it runs elsewhere (unknowable)."""
    if host != socket.gethostname():
        return None
    return pid_alive(pid)


def _staging_writer(name: str) -> tuple[str, int] | None:
    # .tmp-<fp16>.<host>.<pid>.<rand>: the host may itself contain dots.
    parts = name[len(STAGING_PREFIX) :].split(".")
    if len(parts) < 4 or not parts[-2].isdigit():
        return None
    return ".".join(parts[1:-2]), int(parts[-2])


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"


# ---------------------------------------------------------------------------------------------
# The cache


class KernelCache:
    """File-backed program cache under `root` (see the module docstring for the format)."""

    def __init__(self, root: Path | str, *, durable: bool = True, lock_timeout: float = LOCK_TIMEOUT):
        self.root = Path(root).expanduser()
        self.base = self.root / VERSION_DIR
        # durable=False skips fsync: only for synthetic caches (benchmarks), never for real ones.
        self.durable = durable
        self.lock_timeout = lock_timeout

    # -- trust -----------------------------------------------------------------------------

    def trust_problem(self, program: str | None = None) -> str | None:
        """Why loading from this root (and program dir) is refused, or None when it is fine."""
        dirs = [self.root, self.base] + ([self.base / program] if program else [])
        for d in dirs:
            try:
                st = os.stat(d)
            except FileNotFoundError:
                return None
            problem = _ownership_problem(st)
            if problem:
                fix = f"run `chmod go-w {d}` or use" if "writable" in problem else "use"
                return (
                    f"refusing to load programs from {d}: it is {problem} and a compiled program "
                    f"is executable code; {fix} a cache dir of your own (--cache-dir or "
                    "DSV4_KERNEL_CACHE_DIR)"
                )
        return None

    def check_trust(self, program: str | None = None) -> None:
        problem = self.trust_problem(program)
        if problem:
            raise UntrustedCacheError(problem)

    # -- lookup ----------------------------------------------------------------------------

    def lookup(self, program: str, key: Key) -> Hit | Miss:
        """HIT with verified bytes, or MISS with its reason. Corrupt entries are quarantined."""
        return self._resolve(program, key, record=True)

    def probe(self, program: str, key: Key) -> Hit | Miss:
        """`lookup` without side effects (no hit recorded, nothing quarantined): for `why`."""
        return self._resolve(program, key, record=False)

    def _resolve(self, program: str, key: Key, *, record: bool, _again: bool = True) -> Hit | Miss:
        check_program_name(program)
        fp = fingerprint(key)
        if not key.storable:
            unknown = ", ".join(key.unknown_components())
            return Miss(program, fp, "unknown", f"key has unknown components ({unknown}): never cached")
        self.check_trust(program)
        entry = self.base / program / fp
        if not entry.exists():
            return self._closest_miss(program, key, fp)
        try:
            manifest, contents = self._read_verified(entry, program, fp)
        except FileNotFoundError:  # purged or quarantined by another process meanwhile
            return self._closest_miss(program, key, fp)
        except _Corrupt as e:
            kind = "untrusted" if isinstance(e, _Untrusted) else "corrupt"
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
        build = _build_changes(changes, closest, key.as_dict())
        kind = "stale" if build else "absent"
        what = "stale" if build else "not cached for this configuration"
        reason = f"{what}: {describe(list(build or changes))} (closest entry {closest.fingerprint[:12]})"
        return Miss(program, fp, kind, reason, changes)

    def _manifests(self, program: str) -> Iterator[Manifest]:
        for fp, entry in self._entry_dirs(program):
            with contextlib.suppress(OSError, _Corrupt):
                yield Manifest.parse((entry / MANIFEST).read_bytes(), program, fp)

    def _read_verified(self, entry: Path, program: str, fp: str) -> tuple[Manifest, dict[str, bytes]]:
        """Manifest and verified contents of one entry, all read through one directory fd: an
        entry replaced meanwhile (purge + republish) can never mix one writer's manifest with
        another's artifact. A _Corrupt raised here carries `.dir_id`, the (dev, ino) of the dir
        actually read, so only that dir is quarantined."""
        self._check_entry_path(entry)
        try:
            dfd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except NotADirectoryError:
            raise _Corrupt(f"{entry.name} is not a directory") from None
        st = os.fstat(dfd)
        try:
            problem = _ownership_problem(st)
            if problem:
                raise _Untrusted(f"{entry.name} is {problem}")
            manifest = Manifest.parse(self._read_trusted(entry, dfd, MANIFEST), program, fp)
            contents = {}
            for f in manifest.files:
                data = self._read_trusted(entry, dfd, f.name)
                if len(data) != f.size:
                    raise _Corrupt(f"{f.name} has {len(data)} bytes, manifest says {f.size}")
                if sha256_hex(data) != f.sha256:
                    raise _Corrupt(f"{f.name} does not match its sha256")
                contents[f.name] = data
            return manifest, contents
        except _Corrupt as e:
            e.dir_id = (st.st_dev, st.st_ino)
            raise
        finally:
            os.close(dfd)

    def _check_entry_path(self, path: Path) -> os.stat_result:
        if path.is_symlink():
            target = path.resolve()
            if not target.is_relative_to(self.root.resolve()):
                raise _Untrusted(f"{path.name} is a symlink leading outside the cache root ({target})")
        st = os.stat(path)
        problem = _ownership_problem(st)
        if problem:
            raise _Untrusted(f"{path.name} is {problem}")
        return st

    def _read_trusted(self, entry: Path, dfd: int, name: str) -> bytes:
        try:
            if stat.S_ISLNK(os.lstat(name, dir_fd=dfd).st_mode):
                target = (entry / os.readlink(name, dir_fd=dfd)).resolve()
                if not target.is_relative_to(self.root.resolve()):
                    raise _Untrusted(f"{name} is a symlink leading outside the cache root ({target})")
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=dfd)
            try:
                problem = _ownership_problem(os.fstat(fd))
                if problem:
                    raise _Untrusted(f"{name} is {problem}")
                with open(fd, "rb", closefd=False) as f:
                    return f.read()
            finally:
                os.close(fd)
        except FileNotFoundError:
            raise _Corrupt(f"{name} is missing") from None
        except IsADirectoryError:
            raise _Corrupt(f"{name} is not a file") from None
        except OSError as e:
            raise _Corrupt(f"cannot read {name}: {e.strerror}") from None

    def _stamp_hit(self, entry: Path) -> None:
        # One appended byte per hit: size = hit count, mtime = last use. O_APPEND writes of one
        # byte never interleave badly, so concurrent hits need no lock and no manifest rewrite.
        with contextlib.suppress(OSError):
            fd = os.open(entry / HITS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, shared_mode())
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
            return Fetch(self._build_private(program, key, build, config_components), True, first)
        try:
            self._ensure_layout(program)
        except OSError as e:
            if e.errno not in _STORAGE_ERRNOS:
                raise
            log.warning("program cache %s is not writable (%s): %s runs uncached", self.root, e.strerror, program)
            return Fetch(self._build_private(program, key, build, config_components), True, first)
        self.sweep_staging(program)
        with self._compile_lock(program, fingerprint(key)):
            again = self.lookup(program, key)
            if isinstance(again, Hit):
                return Fetch(again, built=False, miss=first)
            # A nearly full cache filesystem: build unpublished (torch's archive writer aborts
            # the whole process on ENOSPC instead of raising, so never let it hit a full disk).
            free = _free_bytes(self.base / program)
            if free is not None and free < MIN_FREE_BYTES:
                log.warning("program cache %s has %d bytes free: %s runs uncached", self.root, free, program)
                return Fetch(self._build_private(program, key, build, config_components), True, first)
            try:
                with self._staging(program, fingerprint(key)) as staging:
                    started = time.perf_counter()
                    build(staging)
                    hit = self._seal(staging, program, key, config_components, time.perf_counter() - started)
                    return Fetch(self._install(staging, hit), built=True, miss=first)
            except OSError as e:
                if e.errno not in _STORAGE_ERRNOS:
                    raise
                log.warning("cannot store %s in program cache %s (%s): it runs uncached",
                            program, self.root, e.strerror)  # fmt: skip
                return Fetch(self._build_private(program, key, build, config_components), True, first)

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
        self._ensure_layout(program)
        with self._staging(program, fingerprint(key)) as staging:
            for name, content in files.items():
                if not _is_artifact_name(name):
                    raise ValueError(f"invalid artifact name {name!r}")
                if isinstance(content, Path):
                    shutil.copyfile(content, staging / name)
                else:
                    (staging / name).write_bytes(content)
            hit = self._seal(staging, program, key, config_components, compile_seconds)
            return self._install(staging, hit)

    def _ensure_layout(self, program: str) -> None:
        check_program_name(program)
        self.root.parent.mkdir(parents=True, exist_ok=True)
        for d in (self.root, self.base, self.base / LOCKS, self.base / program):
            _ensure_dir(d)
        self.check_trust(program)

    @contextlib.contextmanager
    def _compile_lock(self, program: str, fp: str) -> Iterator[None]:
        from filelock import FileLock, Timeout

        lock = FileLock(self.base / LOCKS / f"{program}.{fp}.lock", timeout=self.lock_timeout, mode=0o644)
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
    def _staging(self, program: str, fp: str) -> Iterator[Path]:
        name = f"{STAGING_PREFIX}{fp[:16]}.{socket.gethostname()}.{os.getpid()}.{_rand()}"
        staging = self.base / program / name
        staging.mkdir(mode=0o700)  # private while filling; opened up by _seal
        try:
            yield staging
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # no-op once renamed into place

    def _seal(
        self, staging: Path, program: str, key: Key, config: Collection[str], seconds: float
    ) -> Hit:
        """Hash, chmod and fsync the staged files and write the manifest; the Hit to return."""
        contents, files = {}, []
        for p in sorted(staging.iterdir()):
            if not p.is_file() or p.is_symlink() or not _is_artifact_name(p.name):
                raise ValueError(f"a build may only write plain artifact files, found {p.name!r}")
            data = p.read_bytes()
            contents[p.name] = data
            files.append(ArtifactFile(p.name, sha256_hex(data), len(data)))
            self._finish_file(p)
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
        )
        path = staging / MANIFEST
        path.write_text(json.dumps(manifest.to_json(), indent=1, sort_keys=True))
        self._finish_file(path)
        os.chmod(staging, _dir_mode())
        if self.durable:
            fsync_dir(staging)
        return Hit(program, manifest.fingerprint, None, manifest, contents)

    def _finish_file(self, path: Path) -> None:
        if self.durable:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.chmod(path, shared_mode())

    def _install(self, staging: Path, ours: Hit) -> Hit:
        """Rename the sealed staging dir into its slot; if another writer won, use theirs."""
        final = self.base / ours.program / ours.fingerprint
        try:
            os.rename(staging, final)
        except FileNotFoundError:  # our staging dir was swept from under us: stay unpublished
            return ours
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            theirs = self.lookup(ours.program, ours.manifest.key)
            return theirs if isinstance(theirs, Hit) else ours
        if self.durable:
            fsync_dir(final.parent)
        return replace(ours, path=final)

    def _build_private(
        self, program: str, key: Key, build: Callable[[Path], None], config: Collection[str]
    ) -> Hit:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="dsv4-program-") as tmp:
            staging = Path(tmp)
            started = time.perf_counter()
            build(staging)
            return self._seal(staging, program, key, config, time.perf_counter() - started)

    # -- quarantine, purge, gc ---------------------------------------------------------------

    def quarantine(self, entry: Path, reason: str, expect: tuple[int, int] | None = None) -> Path | None:
        """Move an entry out of the lookup path, keeping it for inspection; None if it vanished
        or, with `expect` (dev, ino), if the dir there now is not the one that was judged."""
        if expect is not None:
            try:
                st = os.stat(entry)
            except FileNotFoundError:
                return None
            if (st.st_dev, st.st_ino) != expect:
                return None
        qdir = self.root / QUARANTINE
        _ensure_dir(qdir)
        dest = qdir / f"{entry.parent.name}--{entry.name[:16]}--{int(time.time())}--{_rand()}"
        try:
            os.rename(entry, dest)
        except FileNotFoundError:
            return None
        note = {"program": entry.parent.name, "fingerprint": entry.name, "reason": reason, "when": time.time()}
        with contextlib.suppress(OSError):
            (dest / QUARANTINE_NOTE).write_text(json.dumps(note))
        return dest

    def reject(self, hit: Hit, reason: str) -> None:
        """A verified entry failed to load: quarantine it so the next lookup MISSes."""
        if hit.path is not None:
            self.quarantine(hit.path, f"load failed: {reason}")

    def remove(self, entries: Iterable[Entry]) -> list[Entry]:
        """Delete entries safely while others read: rename each into the trash, then delete.

        Busy partial entries (their writer may still be running) are skipped.
        """
        trash = self.root / TRASH
        removed = []
        for e in entries:
            if e.busy:
                continue
            _ensure_dir(trash)
            try:
                os.rename(e.path, trash / f"{e.path.name}.{_rand()}")
            except FileNotFoundError:
                continue
            removed.append(e)
        self.empty_trash()
        return removed

    def sweep_staging(self, program: str) -> list[Entry]:
        """Remove the abandoned staging dirs of one program (crashed or long-dead writers)."""
        stale = []
        for d in _scandir(self.base / program):
            if is_staging(d.name):
                entry = _partial_entry(program, Path(d.path))
                if not entry.busy:
                    stale.append(entry)
        return self.remove(stale)

    def empty_trash(self) -> None:
        trash = self.root / TRASH
        if trash.is_dir():
            for p in trash.iterdir():
                shutil.rmtree(p, ignore_errors=True)

    def gc(self, max_size: int, reference: Reference | None = None) -> list[Entry]:
        """Remove abandoned staging dirs and quarantined entries, then least recently used
        entries until the cache holds at most `max_size` bytes."""
        entries = self.inventory(reference)
        garbage = [e for e in entries if e.state in (PARTIAL, CORRUPT) and not e.busy]
        removed = self.remove(garbage)
        gone = {e.path for e in garbage}
        total = sum(e.size_bytes for e in entries if e.path not in gone)
        evict = []
        for e in sorted((e for e in entries if e.path not in gone), key=lambda e: e.last_used):
            if total <= max_size:
                break
            if e.busy:
                continue
            evict.append(e)
            total -= e.size_bytes
        return removed + self.remove(evict)

    # -- inventory ---------------------------------------------------------------------------

    def inventory(self, reference: Reference | None = None) -> list[Entry]:
        """Every entry, staging dir and quarantined entry, with its state against `reference`.

        Checks structure (manifest, file presence and sizes) but hashes nothing: `verify` does.
        """
        reference = reference or Reference()
        out: list[Entry] = []
        for program in self.programs():
            for child in sorted(_scandir(self.base / program), key=lambda d: d.name):
                if is_staging(child.name):
                    out.append(_partial_entry(program, Path(child.path)))
                elif not child.name.startswith(".") and child.is_dir():
                    out.append(self._entry(program, child.path, reference))
        out.extend(self._quarantined())
        return out

    def programs(self) -> list[str]:
        return sorted(d.name for d in _scandir(self.base) if not d.name.startswith(".") and d.is_dir())

    def verify(self) -> Verification:
        """Hash every entry; quarantine those that fail."""
        checked, bad = 0, []
        for program in self.programs():
            for fp, entry in self._entry_dirs(program):
                checked += 1
                try:
                    self._read_verified(entry, program, fp)
                except FileNotFoundError:
                    continue
                except _Corrupt as e:
                    kind = "untrusted" if isinstance(e, _Untrusted) else "corrupt"
                    size = _tree_size(entry)
                    dest = self.quarantine(entry, f"{kind}: {e}", expect=getattr(e, "dir_id", None))
                    if dest is not None:
                        bad.append(Entry(program, fp, CORRUPT, f"{kind}: {e}", size, 0.0, 0.0, 0, dest))
        return Verification(checked, tuple(bad))

    def _entry_dirs(self, program: str) -> Iterator[tuple[str, Path]]:
        for d in _scandir(self.base / program):
            if not d.name.startswith(".") and d.is_dir():
                yield d.name, Path(d.path)

    def _entry(self, program: str, path: str, reference: Reference) -> Entry:
        # Plain strings and one read per manifest: `ls` over thousands of entries stays fast.
        fp = os.path.basename(path)
        hits, last_used = _hit_stats(path)
        try:
            raw = _read_small(os.path.join(path, MANIFEST))
            manifest = Manifest.parse(raw, program, fp)
            size = len(raw) + _artifact_sizes(path, manifest)
        except (OSError, _Corrupt) as e:
            reason = str(e) if isinstance(e, _Corrupt) else f"unreadable: {e}"
            return Entry(program, fp, CORRUPT, reason, _tree_size(Path(path)), 0.0, last_used, hits, Path(path))
        state, reason = judge(manifest, reference)
        return Entry(
            program, fp, state, reason, size, manifest.created, last_used or manifest.created, hits, Path(path)
        )

    def _quarantined(self) -> list[Entry]:
        out = []
        for d in sorted(_scandir(self.root / QUARANTINE), key=lambda d: d.name):
            path = Path(d.path)
            try:
                note = json.loads((path / QUARANTINE_NOTE).read_text())
            except (OSError, ValueError):
                note = {}
            when = float(note.get("when", 0.0))
            out.append(
                Entry(
                    str(note.get("program", d.name.split("--")[0])),
                    str(note.get("fingerprint", "")),
                    CORRUPT,
                    f"quarantined: {note.get('reason', 'unknown reason')}",
                    _tree_size(path),
                    when,
                    when,
                    0,
                    path,
                )
            )
        return out


# ---------------------------------------------------------------------------------------------
# Inventory helpers (module level: pure functions of data on disk)


def judge(manifest: Manifest, reference: Reference) -> tuple[str, str]:
    """(state, reason) of a readable entry against what the caller knows now."""
    live = reference.keys.get(manifest.program)
    if live is not None and reference.fingerprints[manifest.program] == manifest.fingerprint:
        return CURRENT, ""
    if live is not None:
        changes = [c for c in diff(manifest.key, live) if c.new != UNKNOWN]
        present = live.as_dict()
    else:
        old = manifest.key.as_dict()
        changes = [
            Change(n, old[n], v)
            for n, v in reference.components.items()
            if n in old and v != UNKNOWN and old[n] != v
        ]
        present = reference.components
    build = _build_changes(changes, manifest, present)
    if build:
        return STALE, describe(build)
    if live is None:
        return CURRENT, "toolchain matches; no live key for source/layout"
    return OTHER_LAYOUT, describe(changes)


def _build_changes(
    changes: Iterable[Change], manifest: Manifest, present: Collection[str]
) -> list[Change]:
    """Changes that make an entry unusable forever: a non-configuration component that both
    sides have, with another value (toolchain or source). `present`: the other side's names."""
    old = manifest.key.as_dict()
    config = set(manifest.config_components)
    return [c for c in changes if c.component in old and c.component in present and c.component not in config]


def _ownership_problem(st: os.stat_result) -> str | None:
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    if st.st_mode & _GROUP_OR_WORLD_WRITE:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _read_small(path: str) -> bytes:
    # os.read on a raw fd: half the cost of open()/BufferedReader, which shows over 1,000s.
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _hit_stats(entry: str) -> tuple[int, float]:
    try:
        st = os.stat(os.path.join(entry, HITS))
    except OSError:
        return 0, 0.0
    return st.st_size, st.st_mtime


def _artifact_sizes(entry: str, manifest: Manifest) -> int:
    total = 0
    for f in manifest.files:
        try:
            size = os.stat(os.path.join(entry, f.name)).st_size
        except FileNotFoundError:
            raise _Corrupt(f"{f.name} is missing") from None
        if size != f.size:
            raise _Corrupt(f"{f.name} has {size} bytes, manifest says {f.size}")
        total += size
    return total


def _partial_entry(program: str, path: Path) -> Entry:
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        mtime = time.time()
    age = max(0.0, time.time() - mtime)
    writer = _staging_writer(path.name)
    alive = _writer_alive(*writer) if writer else None
    # Young staging dirs may still be filling unless their writer is provably gone; old ones
    # are abandoned whatever the pid says (pids get reused).
    busy = age < STAGING_MAX_AGE and alive is not False
    who = f"pid {writer[1]} on {writer[0]}" if writer else "unknown writer"
    status = "writer running" if alive else "writer gone" if alive is False else "writer on another host"
    reason = f"staging dir of {who}, age {_age(age)} ({status})"
    fp = path.name[len(STAGING_PREFIX) :].split(".")[0]
    return Entry(program, fp, PARTIAL, reason, _tree_size(path), mtime, mtime, 0, path, busy=busy)
