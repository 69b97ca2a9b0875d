"""A file read in order chunk by chunk, in turn or a chunk ahead by a thread: the same bytes,
a short file's end, read errors raised, the thread stopped however the reading ends."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest

from store import pagecache
from store.chunked_read import chunks

CHUNK = 4096


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "read-ahead"]


@pytest.fixture
def blob(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(os.urandom(10 * CHUNK + 123))
    fd = os.open(path, os.O_RDONLY)
    yield path, fd
    os.close(fd)


def _read(fd: int, start: int, size: int, ahead: bool) -> tuple[bytes, list[int]]:
    """The bytes read and each chunk's length (copied: a view lasts until the next)."""
    got, lengths = bytearray(), []
    with contextlib.closing(chunks(fd, start, size, CHUNK, ahead=ahead)) as reads:
        for view in reads:
            got += view
            lengths.append(len(view))
    return bytes(got), lengths


@pytest.mark.parametrize("ahead", [False, True])
def test_the_same_bytes_in_order_from_an_offset(blob, ahead):
    path, fd = blob
    data = path.read_bytes()
    got, lengths = _read(fd, 100, len(data) - 100, ahead)
    assert got == data[100:]
    assert all(n == CHUNK for n in lengths[:-1]) and 0 < lengths[-1] <= CHUNK
    got, _ = _read(fd, 0, 3 * CHUNK + 5, ahead)  # a range inside the file stops at its end
    assert got == data[: 3 * CHUNK + 5]
    assert not _readers()


@pytest.mark.parametrize("ahead", [False, True])
def test_a_file_shorter_than_asked_ends_early_without_error(blob, ahead):
    path, fd = blob
    data = path.read_bytes()
    got, _ = _read(fd, 0, len(data) + 5 * CHUNK, ahead)  # truncated under the reader
    assert got == data
    assert not _readers()


@pytest.mark.parametrize("ahead", [False, True])
def test_a_read_error_is_raised_to_the_caller(tmp_path, ahead):
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: preadv fails with EISDIR
    try:
        with pytest.raises(IsADirectoryError):
            _read(fd, 0, 10 * CHUNK, ahead)
    finally:
        os.close(fd)
    assert not _readers()


def test_any_error_in_the_reading_thread_reaches_the_caller():
    with pytest.raises(TypeError):  # not an fd: raised in the thread, which must not leave the caller waiting
        _read("not an fd", 0, 10 * CHUNK, ahead=True)  # type: ignore[arg-type]
    assert not _readers()


def test_stopping_early_stops_the_reading_thread(blob):
    _, fd = blob
    reads = chunks(fd, 0, 10 * CHUNK, CHUNK, ahead=True)
    assert len(next(reads)) == CHUNK
    assert len(_readers()) == 1  # reading the next chunk, or waiting for a free buffer
    reads.close()
    assert not _readers()


def test_warm_with_a_failing_sink_raises_and_leaves_no_thread(blob):
    path, _ = blob
    seen = []

    def sink(offset: int, data: memoryview) -> None:
        seen.append((offset, len(data)))
        if len(seen) == 2:
            raise ValueError("bad chunk")

    with pytest.raises(ValueError, match="bad chunk"):
        pagecache.warm(path, sink=sink, chunk=CHUNK, remember=False)
    assert seen == [(0, CHUNK), (CHUNK, CHUNK)]
    assert not _readers()


def test_warm_with_a_sink_sees_every_byte_at_its_offset(blob):
    path, _ = blob
    data = path.read_bytes()
    got = bytearray(len(data))

    def sink(offset: int, view: memoryview) -> None:
        got[offset : offset + len(view)] = view

    result = pagecache.warm(path, sink=sink, chunk=CHUNK, remember=False)
    assert result.bytes_read == len(data) and bytes(got) == data
