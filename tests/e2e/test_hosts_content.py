"""Two ranks over two copies of the checkpoint, as two hosts in mount + UTS namespaces where this
machine allows: copies with other mtimes join, other bytes are refused naming the shard
(store.content_id at the rendezvous)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
from hosts import free_port, namespaces_work, stop
from hosts import hosts as make_hosts

CHANGED = "model-00002-of-00003.safetensors"


def _change(model: Path) -> None:
    """The same size, another last byte (a tensor's data)."""
    with open(model / CHANGED, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def _checked(out: Path, rank: int):
    from runtime.events import parse

    path = out / f"events-{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return next((e for e in map(parse, lines) if e.phase == "check" and e.kind == "end"), None)


def _two_ranks(tiny_ckpt_ro, tmp_path, hosts: bool, change: bool):
    if hosts and (why := namespaces_work()):
        pytest.skip(why)
    pair = make_hosts(tmp_path, tiny_ckpt_ro, ["host-a", "host-b"] if hosts else [None, None])
    if change:
        _change(pair[1].root / "model")
    port = free_port()
    procs = [h.rank(r, 2, port, tmp_path) for r, h in enumerate(pair)]
    return procs, [h.name or socket.gethostname() for h in pair]


def test_ranks_over_copies_with_other_mtimes_join(tiny_ckpt_ro, tmp_path):
    """(As namespaced hosts, three of them, in test_hosts_registering's torchrun test.)"""
    procs, names = _two_ranks(tiny_ckpt_ro, tmp_path, False, change=False)
    try:
        deadline = time.monotonic() + 600
        while not all(_checked(tmp_path, r) for r in range(2)):
            dead = [r for r, p in enumerate(procs) if p.poll() is not None]
            assert not dead, (tmp_path / f"stderr-{dead[0]}.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the ranks did not pass the rendezvous"
            time.sleep(0.5)
        for r in range(2):  # both passed the rendezvous, each event naming its own host
            assert _checked(tmp_path, r).host == names[r]
    finally:
        stop(procs)


@pytest.mark.parametrize("hosts", [False, True], ids=["copies", "hosts"])
def test_ranks_over_a_copy_with_other_bytes_are_refused_naming_the_shard(tiny_ckpt_ro, tmp_path, hosts):
    procs, names = _two_ranks(tiny_ckpt_ro, tmp_path, hosts, change=True)
    try:
        for p in procs:
            p.wait(600)
    finally:
        stop(procs)
    assert [p.returncode != 0 for p in procs] == [True, True]
    for r in range(2):
        err = (tmp_path / f"stderr-{r}.log").read_text()
        assert (f"rank 1 on {names[1]} holds a different checkpoint than rank 0 on {names[0]}: "
                f"shard {CHANGED} differs (sha256 ") in err, err[-2000:]
        assert "start every rank with the same checkpoint and settings" in err and "Traceback" not in err

