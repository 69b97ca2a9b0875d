"""Checksums of the sidecar's data region: one xxh3-64 per fixed-size chunk, in the header.

The header check (format.sound_header) proves the layout; only these prove the bytes. A
zeroed or flipped data region maps and validates fine and serves garbage, so the writer
records one checksum per CHUNK_BYTES of data (hashed by reading the data back once written)
and `verify` / `warm --verify` check every chunk and name the tensors of a bad one.
xxh3 runs at memory speed (~8 GB/s here), and each chunk is hashed while the next is read
(`store.chunked_read`), so verifying a hot sidecar costs about a read.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from store import safeio
from store.chunked_read import chunks
from store.sidecar.format import Header, sound_header

ALGORITHM = "xxh3_64"
CHUNK_BYTES = 4 << 20
# Metadata keys: "xxh3_64:<chunk bytes>" and the concatenated 16-hex-digit chunk digests.
SCHEME_KEY = "data_checksum"
DIGESTS_KEY = "data_xxh3_64"
_HEX = 16
READ_BYTES = 4 << 20  # fits the caches better than 16 MiB: measured faster for warm and hash alike


def chunk_count(data_bytes: int, chunk: int = CHUNK_BYTES) -> int:
    return -(-data_bytes // chunk)


def placeholder(data_bytes: int) -> dict[str, str]:
    """Metadata of the right final length, reserved in the header before any data exists."""
    return {SCHEME_KEY: f"{ALGORITHM}:{CHUNK_BYTES}", DIGESTS_KEY: "0" * (_HEX * chunk_count(data_bytes))}


class _Chunker:
    """Hash a data region fed sequentially in pieces of any size, one digest per chunk."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.digests: list[str] = []
        self._h = xxhash.xxh3_64()
        self._filled = 0

    def feed(self, data: memoryview) -> None:
        while data:
            take = min(len(data), self.chunk - self._filled)
            self._h.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self.chunk:
                self._close()

    def _close(self) -> None:
        self.digests.append(self._h.hexdigest())
        self._h.reset()
        self._filled = 0

    def finish(self) -> list[str]:
        if self._filled:
            self._close()
        return self.digests


def compute(fd: int, data_start: int, data_bytes: int) -> dict[str, str]:
    """The checksum metadata of the data region of the open file `fd`."""
    chunker = _Chunker(CHUNK_BYTES)
    done = 0
    with contextlib.closing(chunks(fd, data_start, data_bytes, READ_BYTES, ahead=True)) as reads:
        for view in reads:
            chunker.feed(view)
            done += len(view)
    if done < data_bytes:
        raise OSError(f"file ends {data_bytes - done} bytes early while hashing")
    return {SCHEME_KEY: f"{ALGORITHM}:{CHUNK_BYTES}", DIGESTS_KEY: "".join(chunker.finish())}


@dataclass
class Verifier:
    """Check a sidecar's data chunk by chunk as its bytes stream past (`feed(offset, data)`,
    offsets ascending from 0, the whole file); `result()` once all were fed."""

    header: Header
    problem: str = ""  # why it cannot be checked at all (no or malformed checksums)
    bad: list[int] = field(default_factory=list)
    _chunker: _Chunker | None = None
    _want: list[str] = field(default_factory=list)
    _pos: int = 0
    _checked: int = 0

    def __post_init__(self) -> None:
        meta = self.header.metadata
        scheme, digests = meta.get(SCHEME_KEY), meta.get(DIGESTS_KEY, "")
        if scheme is None:
            self.problem = "no data checksums recorded (packed before they existed); repack to make it checkable"
            return
        algo, _, size = scheme.partition(":")
        data_bytes = sum(e.end - e.begin for e in self.header.entries)
        if algo != ALGORITHM or not size.isdigit() or int(size) <= 0:
            self.problem = f"unknown checksum scheme {scheme[:40]!r}"
        elif len(digests) != _HEX * chunk_count(data_bytes, int(size)):
            self.problem = "checksum list does not match the data size (corrupt header)"
        else:
            self._chunker = _Chunker(int(size))
            self._want = [digests[i : i + _HEX] for i in range(0, len(digests), _HEX)]

    def feed(self, offset: int, data: memoryview) -> None:
        if self._chunker is None or offset != self._pos:
            return
        self._pos += len(data)
        start = self.header.data_start
        if offset + len(data) <= start:
            return
        self._chunker.feed(data[max(0, start - offset) :])
        self._compare()

    def _compare(self) -> None:
        assert self._chunker is not None
        got = self._chunker.digests
        for i in range(self._checked, len(got)):
            if i >= len(self._want) or got[i] != self._want[i]:
                self.bad.append(i)
        self._checked = len(got)

    def result(self) -> VerifyResult:
        if self._chunker is None:
            return VerifyResult(False, self.problem, 0, 0, ())
        self._chunker.finish()
        self._compare()
        self.bad.extend(range(self._checked, len(self._want)))  # never read: the file is short
        chunk = self._chunker.chunk
        named = tuple((i, self.tensors_in(i, chunk)) for i in sorted(set(self.bad)))
        ok = not named
        detail = f"{len(self._want)} chunks verified" if ok else _bad_detail(named, len(self._want))
        return VerifyResult(ok, detail, len(self._want), chunk, named)

    def tensors_in(self, index: int, chunk: int) -> tuple[str, ...]:
        lo = self.header.data_start + index * chunk
        hi = lo + chunk
        return tuple(e.name for e in sorted(self.header.entries, key=lambda e: e.begin)
                     if e.begin < hi and e.end > lo and e.end > e.begin)  # fmt: skip


def _bad_detail(named: tuple[tuple[int, tuple[str, ...]], ...], total: int) -> str:
    names = sorted({n for _, ts in named for n in ts})
    shown = ", ".join(names[:5]) + (f", … ({len(names) - 5} more)" if len(names) > 5 else "")
    return f"{len(named)} of {total} chunks differ from their checksums; tensors: {shown}"


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    detail: str  # one line
    chunks: int
    chunk_bytes: int
    bad: tuple[tuple[int, tuple[str, ...]], ...]  # (chunk index, tensors in it)

    def to_json(self) -> dict:
        return {"verified": self.ok, "detail": self.detail, "chunks": self.chunks,
                "chunk_bytes": self.chunk_bytes,
                "bad_chunks": [{"chunk": i, "tensors": list(ts)} for i, ts in self.bad]}  # fmt: skip


# progress(bytes_done, bytes_total)
Progress = Callable[[int, int], None]


def verifier(fd: int) -> Verifier:
    """A Verifier for the open sidecar `fd`; CorruptSidecar when its header is not sound."""
    header, *_ = sound_header(fd, os.fstat(fd).st_size)
    return Verifier(header)


def verify_file(path: Path | str, progress: Progress | None = None) -> VerifyResult:
    """Read the whole sidecar and check every data chunk against its recorded checksum.

    Raises OSError when it cannot be read (special files included: never blocks) and
    CorruptSidecar when its header is not sound; a bad chunk is a result, not an error.
    """
    fd = safeio.open_regular(path)
    try:
        check = verifier(fd)
        if check.problem:
            return check.result()
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        done = 0
        # truncated under us: the unread chunks count as bad
        with contextlib.closing(chunks(fd, 0, size, READ_BYTES, ahead=True)) as reads:
            for view in reads:
                check.feed(done, view)
                done += len(view)
                if progress is not None:
                    progress(done, size)
        return check.result()
    finally:
        os.close(fd)
