"""store.logs: capped, rotated log files and the slot a run claims (its previous run kept beside)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from store import logs
from store.safeio import NotRegularFile


def test_append_rotates_past_the_cap_and_keeps_whole_lines(tmp_path):
    path = tmp_path / "a.log"
    for i in range(100):
        logs.append_capped(path, f"line {i:03d} {'x' * 40}\n".encode(), cap=1000, keep=2)
    current, first, second = path.read_text(), logs.rotated(path, 1).read_text(), logs.rotated(path, 2).read_text()
    assert all(len(f) <= 1000 for f in (current, first, second))
    assert not logs.rotated(path, 3).exists()  # the oldest dropped
    kept = (second + first + current).splitlines()
    assert kept[-1].startswith("line 099") and all(len(line) == 49 for line in kept)
    numbers = [int(line.split()[1]) for line in kept]
    assert numbers == sorted(numbers) == list(range(numbers[0], 100))  # no line lost between the kept files
    assert logs.read_tail(path, 1 << 20, keep=2) == kept


def test_concurrent_writers_never_interleave_or_lose_a_line_to_rotation(tmp_path):
    path = tmp_path / "t.log"

    def write(name: str) -> None:
        for i in range(300):
            logs.append_capped(path, f"{name} {i} {'y' * 60}\n".encode(), cap=4000, keep=100)

    threads = [threading.Thread(target=write, args=(n,)) for n in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = logs.read_tail(path, 1 << 20, keep=100)
    assert len(lines) == 1200 and all(len(line.split()) == 3 and len(line.split()[2]) == 60 for line in lines)


def test_a_fifo_or_a_link_at_the_path_is_refused_never_written_through(tmp_path):
    fifo = tmp_path / "fifo.log"
    os.mkfifo(fifo)
    with pytest.raises(OSError):  # O_NONBLOCK: no hang waiting for a reader (ENXIO without one)
        logs.append_capped(fifo, b"x\n", 100)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # with one, refused as not a regular file
    try:
        with pytest.raises(NotRegularFile):
            logs.append_capped(fifo, b"x\n", 100)
    finally:
        os.close(reader)
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    (tmp_path / "link.log").symlink_to(target)
    with pytest.raises(OSError):
        logs.append_capped(tmp_path / "link.log", b"x\n", 100)
    assert target.read_text() == "keep\n"


def test_claiming_a_slot_keeps_the_previous_run_beside_it(tmp_path):
    path = tmp_path / "logs" / "serve-8000.log"
    code = ("import sys; from pathlib import Path; from store import logs; s = logs.claim(Path(sys.argv[1])); "
            "logs.append_capped(s.path, f'run {sys.argv[2]}\\n'.encode(), 1 << 20); print(s.path, s.previous)")
    first = subprocess.run([sys.executable, "-c", code, str(path), "1"], capture_output=True, text=True, check=True)
    assert first.stdout.split() == [str(path), "None"]
    second = subprocess.run([sys.executable, "-c", code, str(path), "2"], capture_output=True, text=True, check=True)
    assert second.stdout.split() == [str(path), str(logs.previous_of(path))]
    assert path.read_text() == "run 2\n" and logs.previous_of(path).read_text() == "run 1\n"


def test_a_slot_a_live_process_holds_is_left_alone(tmp_path):
    path = tmp_path / "serve-9000.log"
    held = logs.claim(path)  # this process: the slot's live run
    logs.append_capped(held.path, b"live\n", 1 << 20)
    code = "import sys; from pathlib import Path; from store import logs; print(logs.claim(Path(sys.argv[1])).path)"
    other = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert other.stdout.strip() != str(path) and other.stdout.strip().startswith(str(tmp_path / "serve-9000-"))
    assert path.read_text() == "live\n" and not logs.previous_of(path).exists()
