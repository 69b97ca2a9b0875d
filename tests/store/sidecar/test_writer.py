"""Sidecar files, writing: the streaming writer, the source key taken before packing, a kill
mid-write and the sweep of its leftovers."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from sidecar_samples import (
    REPO,
    SETTINGS,
    SHARDS,
    assert_equal_tensors,
    key_of,
    sample_tensors,
    write,
)
from sidecar_samples import model_dir as model_dir  # a fixture
from sidecar_samples import state_dir as state_dir  # a fixture (autouse)

from store import atomic, sidecar
from store.errors import UserError
from store.sidecar import MAP, REPACK

# --- writer -----------------------------------------------------------------------------------


def test_written_sidecar_loads_with_safetensors_and_equals_the_tensors_given(model_dir):
    path, key, info = write(model_dir)
    assert path == model_dir / "dsv4-packed.r2.safetensors"
    assert_equal_tensors(load_file(path), sample_tensors())
    assert info.size_bytes == path.stat().st_size and info.tensors == len(sample_tensors())

    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert meta["format"] == "dsv4-packed-test" and meta["packer_version"] == "t1"
    assert meta["ranks"] == "2" and meta["source_fingerprint"] == sidecar.fingerprint(key)
    assert sidecar.Key.from_json(json.loads(meta["source_key"])) == key
    assert float(meta["created"]) > 0 and float(meta["pack_seconds"]) == info.pack_seconds


def test_header_is_on_disk_before_the_first_tensor_is_consumed(model_dir):
    tensors = sample_tensors()
    seen = {}

    def stream():
        [staging] = [p for p in model_dir.iterdir() if atomic.is_staging(p.name)]
        fd = os.open(staging, os.O_RDONLY)
        try:
            seen["names"] = {e.name for e in sidecar.read_header(fd, os.fstat(fd).st_size).entries}
        finally:
            os.close(fd)
        yield from tensors.items()

    write(model_dir, stream=stream())
    assert seen["names"] == set(tensors)


def test_writer_releases_each_tensor_before_the_next_is_packed(model_dir):
    tensors = sample_tensors()
    refs: list[weakref.ref] = []
    alive_when_packing: list[int] = []

    def stream():
        for name, proto in tensors.items():
            alive_when_packing.append(sum(r() is not None for r in refs))
            t = proto.clone()
            refs.append(weakref.ref(t))
            yield name, t
            del t

    write(model_dir, stream=stream())
    assert alive_when_packing == [0] * len(tensors)


def test_every_view_is_aligned_to_its_element_size(model_dir):
    path, key, _ = write(model_dir)
    verdict, mapped = sidecar.open_sidecar(path, expected_key=key)
    assert verdict.action == MAP
    with mapped:
        for t in mapped.tensors.values():
            if t.numel():
                assert t.data_ptr() % t.element_size() == 0


def _swap(items, name, fn):
    return [(n, fn(t) if n == name else t) for n, t in items]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda items: [("wrong", torch.zeros(1)), *items], "not in the layout"),
        (lambda items: _swap(items, "layers.scale", lambda t: t.double()), "dtype"),
        (lambda items: _swap(items, "layers.w_int8", lambda t: t.reshape(5, 3)), "shape"),
        (
            lambda items: [(n, t) for n, t in items if n not in ("mask", "fp8")],
            "incomplete: mask (missing), fp8 (missing)",
        ),
        (lambda items: [*items, items[0]], "yielded twice"),
    ],
    ids=["name", "dtype", "shape", "too-few", "twice"],
)
def test_a_stream_that_disagrees_with_its_plan_publishes_nothing(model_dir, mutate, message):
    tensors = sample_tensors()
    items = list(reversed(tensors.items()))  # any order is fine: the plan fixes the layout
    with pytest.raises(ValueError, match=re.escape(message)):
        write(model_dir, tensors=tensors, stream=iter(mutate(items)))
    assert sidecar.find_sidecars(model_dir) == []
    assert not [p for p in model_dir.iterdir() if atomic.is_staging(p.name)]


def test_stacked_tensors_are_written_slice_by_slice_in_any_order(model_dir):
    experts = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5)
    layers = torch.arange(3 * 6, dtype=torch.int8).reshape(3, 6)
    tensors = {"layers.experts.w1": experts, "layers.norm": layers}
    parts = [
        ("layers.experts.w1", (rank, layer, e), experts[rank, layer, e])
        for rank in range(2)
        for layer in range(3)
        for e in range(4)
    ]
    parts += [("layers.norm", (i,), layers[i]) for i in range(3)]
    path, _, _ = write(model_dir, tensors=tensors, stream=iter(reversed(parts)))
    assert_equal_tensors(load_file(path), tensors)

    for bad, message in [
        ([*parts[:-1], ("layers.norm", (3,), layers[0])], "outside its leading dims"),
        ([*parts, ("layers.norm", (), layers)], "mix index depths"),
        (parts[1:], "layers.experts.w1 (23 of 24 slices)"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            write(model_dir, path=model_dir / "bad.safetensors", tensors=tensors, stream=iter(bad))
    assert not (model_dir / "bad.safetensors").exists()


def test_refuses_to_overwrite_without_force_and_replaces_with_force(model_dir):
    path, _, _ = write(model_dir, extra={"generation": "1"})
    with pytest.raises(UserError, match="already exists; pass --force"):
        write(model_dir, extra={"generation": "2"})
    write(model_dir, extra={"generation": "2"}, force=True)
    with safe_open(path, "pt") as f:
        assert f.metadata()["generation"] == "2"


def test_mode_is_copied_from_the_source_shard_and_is_never_mkstemps_0600(model_dir, tmp_path):
    shard = model_dir / SHARDS[0]
    shard.chmod(0o640)
    path, _, _ = write(model_dir, mode_from=shard)
    assert path.stat().st_mode & 0o777 == 0o640
    other, _, _ = write(model_dir, path=tmp_path / "plain.safetensors")
    assert other.stat().st_mode & 0o777 == atomic.shared_mode()


def test_source_key_names_every_input_of_the_packing(model_dir):
    parts = key_of(model_dir).as_dict()
    assert [*parts][:6] == [
        "format", "packer_version", "ranks", "layout", "config_sha256", "weight_map_sha256",
    ]  # fmt: skip
    st = (model_dir / SHARDS[1]).stat()
    assert parts[f"shard:{SHARDS[1]}"] == {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    with pytest.raises(UserError, match="config.json: not found"):
        sidecar.source_key(model_dir / "nope", **SETTINGS)


def test_key_is_taken_before_packing_so_a_shard_touched_while_writing_leaves_it_stale(model_dir):
    tensors = sample_tensors()

    def stream():
        for i, item in enumerate(tensors.items()):
            if i == 3:
                os.utime(model_dir / SHARDS[1], ns=(1, 1))
            yield item

    path, key, info = write(model_dir, stream=stream())
    assert SHARDS[1] in info.stale_detail
    verdict = sidecar.inspect(path)  # judged against the checkpoint it records
    assert (verdict.action, verdict.reason) == (REPACK, "stale")
    assert verdict.changes == (
        f"shard:{SHARDS[1]}'s mtime_ns is {key.as_dict()[f'shard:{SHARDS[1]}']['mtime_ns']} here; this launch uses 1",
    )


SIGKILL_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from pathlib import Path
    from store import sidecar
    model_dir = Path(sys.argv[1])
    settings = json.loads(sys.argv[2])
    key = sidecar.source_key(model_dir, **settings)
    plan = [sidecar.TensorShape(f"t{i}", "F32", (256,)) for i in range(4)]

    def stream():
        yield "t0", torch.zeros(256)
        print("packing", flush=True)
        sys.stdin.readline()  # blocks until the parent kills us
        yield from ((f"t{i}", torch.zeros(256)) for i in range(1, 4))

    sidecar.write_sidecar(sidecar.default_sidecar_path(model_dir, 2), plan, stream(),
                          metadata=sidecar.sidecar_metadata(key, model_dir))
    """
)


def test_sigkill_mid_write_leaves_no_final_file_and_the_leftover_is_swept(model_dir):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", SIGKILL_CHILD, str(model_dir), json.dumps(SETTINGS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=REPO, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "packing"
        [staging] = [p for p in model_dir.iterdir() if atomic.is_staging(p.name)]
        assert sidecar.sweep_temp_files(model_dir, remove=False) == []  # its writer is alive
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert sidecar.find_sidecars(model_dir) == []
    assert sidecar.inspect(sidecar.default_sidecar_path(model_dir, 2)).reason == "missing"
    assert sidecar.sweep_temp_files(model_dir, remove=False) == [staging]
    assert sidecar.sweep_temp_files(model_dir) == [staging]
    assert not staging.exists()


def test_sweep_waits_for_foreign_hosts_leftovers_to_age(model_dir):
    foreign = model_dir / ".tmp-dsv4-packed.r2.safetensors.other-host.example.123.abcdef01"
    foreign.write_bytes(b"partial")
    unrelated = model_dir / ".tmp-config.json.other-host.123.abcdef01"
    unrelated.write_bytes(b"{}")
    assert sidecar.sweep_temp_files(model_dir) == []
    os.utime(foreign, (1, 1))
    os.utime(unrelated, (1, 1))
    assert sidecar.sweep_temp_files(model_dir) == [foreign]
    assert unrelated.exists() and not foreign.exists()



# --- whole blocks -----------------------------------------------------------------------------


def _recorded_blocks(monkeypatch):
    from store.sidecar import blocks

    writes = []
    real = blocks.pwrite_all

    def record(fd, data, offset):
        writes.append((offset, memoryview(data).nbytes))
        real(fd, data, offset)

    monkeypatch.setattr(blocks, "pwrite_all", record)
    return blocks, writes


@pytest.mark.parametrize("max_staged", [64, 1])
def test_scattered_pieces_are_written_as_whole_aligned_blocks(tmp_path, monkeypatch, max_staged):
    """Pieces of any size in any order reach the file as whole blocks at block offsets (the page
    cache then keeps each as one large folio); past the staging limit the fullest block goes out
    as its pieces. Either way the file holds every byte given, once."""
    blocks, writes = _recorded_blocks(monkeypatch)
    block, size = 4096, 5 * 4096 + 100
    rng = random.Random(0)
    want = rng.randbytes(size)
    cuts = sorted({0, size, *(rng.randrange(size) for _ in range(30))})
    order = list(itertools.pairwise(cuts))
    rng.shuffle(order)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        out = blocks.BlockWriter(fd, size, block=block, max_staged=max_staged)
        for a, b in order:
            out.write(want[a:b], a)
        out.flush()
    finally:
        os.close(fd)
    assert path.read_bytes() == want
    whole = [(o, n) for o, n in writes if o % block == 0 and n == min(block, size - o)]
    if max_staged == 64:
        assert sorted(writes) == sorted(whole) and len(whole) == 6
    else:
        assert len(whole) < 6 and sum(n for _, n in writes) == size


def test_a_write_past_the_end_is_refused(tmp_path):
    from store.sidecar.blocks import BlockWriter

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(ValueError, match="past the file"):
            BlockWriter(fd, 10, block=4).write(b"abc", 9)
    finally:
        os.close(fd)
