"""A mapped sidecar changed under its reader (issue 11 item 3, the store side): the reader
learns of a writer before a byte changes (read lease) or right after (fd identity), and the
bytes it serves stay the ones it validated until it lets go."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from store import sidecar
from store.checkpoint import CONFIG_NAME, INDEX_NAME
from store.sidecar.watch import Watch

SHARD = "model-00001-of-00001.safetensors"
SETTINGS = {"format": "dsv4-packed-test", "packer_version": "t1", "ranks": 1, "layout": {"tp": 1}}


@pytest.fixture
def mapped_pair(tmp_path):
    """A sidecar mapped by this process, and another sidecar of the same size and layout."""
    d = tmp_path / "model"
    d.mkdir()
    (d / CONFIG_NAME).write_text(json.dumps({"model_type": "deepseek_v4"}))
    save_file({"w": torch.ones(2)}, d / SHARD)
    (d / INDEX_NAME).write_text(json.dumps({"weight_map": {"w": SHARD}}))
    key = sidecar.source_key(d, **SETTINGS)
    paths = []
    for fill in (1.0, 2.0):
        path = d / f"{fill:.0f}.safetensors"
        plan = [sidecar.TensorShape("w", "F32", (1024,))]
        sidecar.write_sidecar(path, plan, iter([("w", torch.full((1024,), fill))]),
                              metadata={**sidecar.sidecar_metadata(key, d), "created": "1"})
        paths.append(path)
    verdict, mapped = sidecar.open_sidecar(paths[0], expected_key=key)
    assert mapped is not None, verdict.line()
    yield mapped, paths
    mapped.close()


def test_a_fresh_mapping_is_unchanged_and_holds_a_lease(mapped_pair):
    mapped, _ = mapped_pair
    assert mapped.changed() is None
    assert mapped.watched_by in ("lease", "fstat")


def test_truncate_is_noticed_before_it_happens_and_the_bytes_stay_valid(mapped_pair):
    mapped, (path, _) = mapped_pair
    if mapped.watched_by != "lease":
        pytest.skip("no read lease on this filesystem")
    proc = subprocess.run(["truncate", "-s", "0", str(path)], capture_output=True, text=True, timeout=60)
    # GNU truncate opens without blocking: the lease makes it fail instead of shrinking the file
    assert proc.returncode != 0 and path.stat().st_size > 0
    assert "lease broken" in (mapped.changed() or "")
    assert torch.equal(mapped.tensors["w"], torch.full((1024,), 1.0))  # no SIGBUS, same bytes


def test_a_same_size_copy_over_waits_for_release_and_the_reader_knows_first(mapped_pair):
    mapped, (path, other) = mapped_pair
    assert path.stat().st_size == other.stat().st_size
    if mapped.watched_by != "lease":
        pytest.skip("no read lease on this filesystem")
    cp = subprocess.Popen(["cp", str(other), str(path)])
    try:
        assert "lease broken" in (mapped._watch.wait_changed(timeout=30) or "")
        assert cp.poll() is None  # the writer waits on our lease …
        assert torch.equal(mapped.tensors["w"], torch.full((1024,), 1.0))  # … so we still serve ours
        mapped.release()  # the service stopped serving: let the writer go
        assert cp.wait(timeout=30) == 0
    finally:
        if cp.poll() is None:
            cp.kill()
    assert path.read_bytes() == other.read_bytes()


def test_without_a_lease_an_in_place_write_is_seen_by_fd_identity(mapped_pair, tmp_path):
    _, (path, other) = mapped_pair
    copy = tmp_path / "copy.safetensors"
    shutil.copyfile(path, copy)
    fd = os.open(copy, os.O_RDONLY)
    try:
        watch = Watch(fd, copy, lease=False)
        assert watch.mechanism == "fstat" and watch.changed() is None
        data = other.read_bytes()
        with open(copy, "r+b") as f:  # same size, new bytes, new mtime
            f.write(data)
        os.utime(copy, ns=(1, 1))  # a coarse-mtime filesystem must still differ
        assert "changed" in (watch.changed() or "")
    finally:
        os.close(fd)


def test_a_path_replaced_by_rename_keeps_serving_the_validated_bytes(mapped_pair):
    mapped, (path, other) = mapped_pair
    tmp = path.with_name("staged")
    shutil.copyfile(other, tmp)
    os.replace(tmp, path)  # what prepack --force does: the mapped inode is untouched
    assert mapped.changed() is None
    assert torch.equal(mapped.tensors["w"], torch.full((1024,), 1.0))


def test_a_mapping_dropped_without_close_gives_its_lease_back(mapped_pair):
    import gc

    mapped, (path, _) = mapped_pair
    key = sidecar.Key.from_json(json.loads(mapped.metadata["source_key"]))
    _, again = sidecar.open_sidecar(path, expected_key=key)
    assert again is not None
    leased = again.watched_by == "lease"
    del again
    gc.collect()
    mapped.close()
    # with a lease still held, a non-blocking open for writing fails with EAGAIN
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    os.close(fd)
    assert leased or pytest.skip("no read lease on this filesystem")


def test_notify_tells_an_idle_reader_from_a_background_thread(mapped_pair):
    import threading

    mapped, (path, other) = mapped_pair
    if mapped.watched_by != "lease":
        pytest.skip("no read lease on this filesystem")
    told: list[str] = []
    seen = threading.Event()
    stop = mapped.notify(lambda reason: (told.append(reason), seen.set()), interval=0.05)
    cp = subprocess.Popen(["cp", str(other), str(path)])
    try:
        assert seen.wait(30) and "lease broken" in told[0]
        mapped.release()
        assert cp.wait(timeout=30) == 0
    finally:
        stop()
        if cp.poll() is None:
            cp.kill()
