"""`safeio.read_fd`: a regular file whole (read in one call of its size + 1), a pipe in pieces,
and never more than its cap."""

from __future__ import annotations

import os
import threading

import pytest

from store import safeio


def test_a_regular_file_a_pipe_and_an_offset_are_read_whole(tmp_path):
    data = os.urandom((3 << 20) + 7)
    path = tmp_path / "blob"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert safeio.read_fd(fd, len(data)) == data
        os.lseek(fd, 5, os.SEEK_SET)  # from the current offset
        assert safeio.read_fd(fd) == data[5:]
    finally:
        os.close(fd)
    r, w = os.pipe()  # st_size 0: read in pieces to its end (more than a pipe's buffer)

    def write() -> None:
        with os.fdopen(w, "wb") as f:
            f.write(data[:200_000])

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert safeio.read_fd(r, 1 << 20, "pipe") == data[:200_000]
    finally:
        writer.join()
        os.close(r)


def test_a_file_over_its_cap_or_a_pipe_past_it_is_refused(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(b"x" * 1000)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(safeio.TooLarge, match="over the 999-byte limit"):
            safeio.read_fd(fd, 999, "blob")
    finally:
        os.close(fd)
    r, w = os.pipe()
    os.write(w, b"y" * 5000)
    os.close(w)
    try:
        with pytest.raises(safeio.TooLarge, match="grew past the 4096-byte limit"):
            safeio.read_fd(r, 4096, "pipe")
    finally:
        os.close(r)
