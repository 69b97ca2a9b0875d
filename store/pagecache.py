"""Page-cache residency, warming and eviction of one file. No torch.

Residency comes from `cachestat(2)` (Linux ≥ 6.5: exact, no mapping) where the kernel and the
seccomp profile allow it, else from `mincore(2)` over bounded windows, so probing a 300 GiB
file never maps it whole. mincore reports page-cache residency of file pages only for files the
caller owns or could open for writing (kernel ≥ 5.0); for other files it sees only pages this
process mapped, which reads as "cold": cachestat has no such limit.

The read throughput `warm` measures on cold bytes is remembered in a small JSON under the user
state dir; the sidecar's cold policy compares it with the time a repack would take.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import mmap
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from store import atomic, paths
from store.chunked_read import chunks

log = logging.getLogger(__name__)

PAGE_SIZE = mmap.PAGESIZE
# mincore windows: 1 GiB of file per mapping → a 256 KiB vector with 4 KiB pages.
MINCORE_WINDOW = 1 << 30
WARM_CHUNK = 16 << 20

# cachestat is syscall 451 in the generic table (aarch64) and on x86_64.
_CACHESTAT_NR = {"x86_64": 451, "aarch64": 451, "arm64": 451}.get(platform.machine())
_FALLBACK_ERRNOS = {errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP, errno.EACCES}

# Used by the cold policy until `warm` has measured this host. 500 MB/s is a conservative
# single-NVMe-or-network-disk figure (the reference host read 323 GiB in 578 s ≈ 0.6 GB/s).
DEFAULT_READ_BYTES_PER_S = 500e6
# Reads shorter than this mostly measure latency and readahead, not throughput: not recorded.
MIN_MEASURED_BYTES = 64 << 20
THROUGHPUT_FILE = "read-throughput.json"

METHODS = ("cachestat", "mincore")


@dataclass(frozen=True)
class Residency:
    """How much of a file sits in the page cache at `sampled_at` (time.time())."""

    fraction: float
    cached_pages: int
    total_pages: int
    method: str
    sampled_at: float

    @property
    def cached_bytes(self) -> int:
        return self.cached_pages * PAGE_SIZE

    def to_json(self) -> dict:
        return {
            "fraction": self.fraction,
            "cached_pages": self.cached_pages,
            "total_pages": self.total_pages,
            "method": self.method,
            "sampled_at": self.sampled_at,
        }


class _CachestatRange(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _Cachestat(ctypes.Structure):
    _fields_ = tuple(
        (n, ctypes.c_uint64)
        for n in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    )


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
_MAP_FAILED = ctypes.c_void_p(-1).value

# None: not tried yet; False: the kernel or sandbox refused it once, so skip it from then on.
_cachestat_works: bool | None = None


def _pages(size: int) -> int:
    return -(-size // PAGE_SIZE)


def _cachestat(fd: int) -> int:
    """Cached pages of the whole file, or OSError (ENOSYS/EPERM where unavailable)."""
    if _CACHESTAT_NR is None:
        raise OSError(errno.ENOSYS, "cachestat: no syscall number for this architecture")
    rng, out = _CachestatRange(0, 0), _Cachestat()  # len 0 = to the end of the file
    rc = _libc.syscall(
        ctypes.c_long(_CACHESTAT_NR),
        ctypes.c_int(fd),
        ctypes.byref(rng),
        ctypes.byref(out),
        ctypes.c_uint(0),
    )
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"cachestat: {os.strerror(e)}")
    return int(out.nr_cache)


def _mincore(fd: int, size: int) -> int:
    """Cached pages counted by mincore over mappings of at most MINCORE_WINDOW bytes each.

    The residency vector is counted by numpy (a Python loop over 78 M bytes of a 300 GiB file
    took seconds); one vector is reused for every window."""
    import numpy as np  # lazily: only the fallback path needs it

    window = max(PAGE_SIZE, MINCORE_WINDOW - MINCORE_WINDOW % PAGE_SIZE)
    vec = (ctypes.c_ubyte * _pages(min(window, size)))()
    view = np.frombuffer(vec, dtype=np.uint8)
    cached = 0
    for off in range(0, size, window):
        length = min(window, size - off)
        addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, off)
        if addr in (None, _MAP_FAILED):
            e = ctypes.get_errno()
            raise OSError(e, f"mmap for mincore: {os.strerror(e)}")
        try:
            if _libc.mincore(ctypes.c_void_p(addr), length, vec) != 0:
                e = ctypes.get_errno()
                raise OSError(e, f"mincore: {os.strerror(e)}")
            cached += int(np.count_nonzero(view[: _pages(length)] & 1))
        finally:
            _libc.munmap(ctypes.c_void_p(addr), length)
    return cached


def cachestat_available() -> bool:
    """Whether this kernel (and sandbox) answers cachestat; probed once on a tiny file."""
    global _cachestat_works
    if _cachestat_works is None:
        fd = os.open(__file__, os.O_RDONLY)
        try:
            _cachestat(fd)
            _cachestat_works = True
        except OSError:
            _cachestat_works = False
        finally:
            os.close(fd)
    return _cachestat_works


def residency(fd: int, *, method: str | None = None) -> Residency:
    """Page-cache residency of the open file `fd` (cachestat, else bounded mincore windows).

    `method` forces one probe (tests and benchmarks compare them); a forced method that the
    kernel refuses raises OSError.
    """
    global _cachestat_works
    if method not in (None, *METHODS):
        raise ValueError(f"unknown residency method {method!r} (use one of {METHODS})")
    size = os.fstat(fd).st_size
    total = _pages(size)
    chosen = method
    cached: int | None = None
    if method == "cachestat" or (method is None and _cachestat_works is not False):
        try:
            cached = _cachestat(fd)
            _cachestat_works = True
            chosen = "cachestat"
        except OSError as e:
            if method == "cachestat" or e.errno not in _FALLBACK_ERRNOS:
                raise
            _cachestat_works = False
            log.debug("cachestat unavailable (%s); using mincore", e)
    if cached is None:
        return _scheduled_mincore(fd, size, total)
    cached = min(cached, total)
    fraction = cached / total if total else 1.0
    return Residency(fraction, cached, total, chosen, time.time())


# -- the mincore fallback on a schedule ----------------------------------------------------------
# A process that probes residency on every refresh (the console, every 2 s) would spend seconds
# per refresh on a 300 GiB file where only mincore answers. `schedule(share)` bounds that: a
# mincore sample of a file is reused until `cost / share` seconds have passed since it was
# taken (cost = the CPU seconds it took), so sampling stays within `share` of one core. Its
# `sampled_at` says how old it is. Off by default: the CLI and the loader always probe afresh.

_schedule_share: float | None = None
_samples: dict[tuple[int, int, int, int], tuple[Residency, float, float]] = {}  # id → (res, cost, taken)
MAX_SAMPLES = 64
# what a process that refreshes forever (the console) lets the mincore fallback use: 1.5 % of a
# core, so that with the first sample counted in a few minutes of refreshes stay within 2 %
REFRESH_SHARE = 0.015


def schedule(share: float | None, clock: Callable[[], float] = time.monotonic) -> None:
    """Reuse mincore samples so they cost at most `share` of a core (None: always probe)."""
    global _schedule_share, _clock
    if share is not None and not 0 < share <= 1:
        raise ValueError(f"share must be within (0, 1], got {share}")
    _schedule_share, _clock = share, clock
    _samples.clear()


_clock: Callable[[], float] = time.monotonic


def _identity(fd: int) -> tuple[int, int, int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _scheduled_mincore(fd: int, size: int, total: int) -> Residency:
    ident = _identity(fd) if _schedule_share else None
    if ident is not None and ident in _samples:
        res, cost, taken = _samples[ident]
        if _clock() - taken < cost / _schedule_share:
            return res
    start = time.thread_time()
    cached = min(_mincore(fd, size) if size else 0, total)
    res = Residency(cached / total if total else 1.0, cached, total, "mincore", time.time())
    if ident is not None:
        if len(_samples) >= MAX_SAMPLES:
            _samples.pop(next(iter(_samples)))
        _samples[ident] = (res, time.thread_time() - start, _clock())
    return res


def residency_path(path: Path | str, *, method: str | None = None) -> Residency:
    fd = os.open(path, os.O_RDONLY)
    try:
        return residency(fd, method=method)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class WarmResult:
    path: str
    bytes_read: int
    seconds: float
    cold_bytes: int  # bytes that were not cached before the read
    before: Residency
    after: Residency

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else float("inf")

    @property
    def cold_bytes_per_s(self) -> float | None:
        """Disk read throughput: cold bytes over elapsed time (None if too little was cold)."""
        if self.cold_bytes < MIN_MEASURED_BYTES or self.seconds <= 0:
            return None
        return self.cold_bytes / self.seconds

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "bytes_read": self.bytes_read,
            "seconds": self.seconds,
            "bytes_per_s": self.bytes_per_s,
            "cold_bytes": self.cold_bytes,
            "cold_bytes_per_s": self.cold_bytes_per_s,
            "before": self.before.to_json(),
            "after": self.after.to_json(),
        }


# progress(bytes_done, bytes_total, bytes_per_s)
WarmProgress = Callable[[int, int, float], None]


def warm(
    path: Path | str,
    progress: WarmProgress | None = None,
    *,
    willneed: bool = True,
    chunk: int = WARM_CHUNK,
    remember: bool = True,
    sink: Callable[[int, memoryview], None] | None = None,
) -> WarmResult:
    """Read the whole file sequentially in large chunks so it lands in the page cache.

    With `remember`, a throughput measured over enough cold bytes is stored for the cold policy.
    `sink(offset, bytes)` sees every chunk read (the sidecar verifier hashes while warm reads).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        before = residency(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        if willneed:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        done, start = 0, time.monotonic()
        # truncated under us: warm what is there. With a sink, the next chunk is read while it
        # sees this one (`chunked_read`).
        with contextlib.closing(chunks(fd, 0, size, chunk, ahead=sink is not None)) as reads:
            for view in reads:
                if sink is not None:
                    sink(done, view)
                done += len(view)
                if progress is not None:
                    elapsed = time.monotonic() - start
                    progress(done, size, done / elapsed if elapsed > 0 else 0.0)
        seconds = time.monotonic() - start
        after = residency(fd)
    finally:
        os.close(fd)
    cold = max(0, min(size, (before.total_pages - before.cached_pages) * PAGE_SIZE))
    result = WarmResult(str(path), done, seconds, cold, before, after)
    if remember and result.cold_bytes_per_s is not None:
        remember_read_throughput(result.cold_bytes_per_s, result.cold_bytes)
    return result


def evict(path: Path | str) -> Residency:
    """Drop the file's clean pages from the page cache (POSIX_FADV_DONTNEED); residency after.

    Dirty pages cannot be dropped, so the file's data is flushed first. Pages another process
    has mapped and is using may stay.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            os.fdatasync(fd)
        except OSError as e:  # e.g. EINVAL on special filesystems: dropping clean pages still helps
            log.debug("fdatasync %s before evict: %s", path, e)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return residency(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Throughput:
    bytes_per_s: float
    measured: bool  # False: the documented default, this host was never measured
    measured_at: float | None = None
    bytes_measured: int | None = None


def _throughput_path() -> Path:
    return paths.state_dir() / THROUGHPUT_FILE


def read_throughput() -> Throughput:
    """This host's remembered cold-read throughput, or DEFAULT_READ_BYTES_PER_S if unknown."""
    try:
        data = json.loads(_throughput_path().read_text())
        bps = float(data["bytes_per_s"])
        if not bps > 0:
            raise ValueError("non-positive throughput")
        return Throughput(bps, True, float(data.get("measured_at", 0)), int(data.get("bytes", 0)))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.debug("ignoring unreadable %s: %s", _throughput_path(), e)
    return Throughput(DEFAULT_READ_BYTES_PER_S, False)


def remember_read_throughput(bytes_per_s: float, nbytes: int) -> None:
    target = _throughput_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    data = {"bytes_per_s": bytes_per_s, "bytes": nbytes, "measured_at": time.time()}
    atomic.write_bytes_atomic(target, (json.dumps(data) + "\n").encode())
