"""A checkpoint's identity by content (store.content_id), how the plan shows it, and the ranks'
rendezvous comparing it: copies with other mtimes serve together, other bytes are refused by shard."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from runtime.launch.agree import Join, disagreement
from store.content_id import (
    COMPUTED,
    HF_METADATA_DIR,
    HUB_BLOB,
    HUB_METADATA,
    REMEMBERED,
    UNKNOWN,
    content_id,
    digest_cache_dir,
)
from store.errors import UserError


def _ckpt(root: Path, shards: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"hidden": 8}')
    weight_map = {f"t{i}": name for i, name in enumerate(shards)}
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for name, data in shards.items():
        (root / name).write_bytes(data)
    return root


SHARDS = {"model-00001-of-00002.safetensors": b"a" * 4096, "model-00002-of-00002.safetensors": b"b" * 1000}


def _hows(cid) -> dict[str, str]:
    return {s.name: s.how for s in cid.shards}


def test_digest_is_computed_once_then_remembered(tmp_path):
    model = _ckpt(tmp_path / "m", SHARDS)
    first = content_id(model)
    assert set(_hows(first).values()) == {COMPUTED}
    entries = sorted(digest_cache_dir().iterdir())
    assert len(entries) == 2
    by_path = {json.loads(e.read_text())["path"]: json.loads(e.read_text()) for e in entries}
    entry = by_path[str(model / "model-00002-of-00002.safetensors")]
    assert entry["sha256"] == hashlib.sha256(b"b" * 1000).hexdigest()
    st = os.stat(model / "model-00002-of-00002.safetensors")
    assert entry["file"] == {"dev": st.st_dev, "ino": st.st_ino, "size": 1000, "mtime_ns": st.st_mtime_ns,
                             "ctime_ns": st.st_ctime_ns}
    second = content_id(model)
    assert set(_hows(second).values()) == {REMEMBERED}
    assert second.identity == first.identity and second.summary().endswith("(2 shards: 2 remembered)")
    assert sorted(digest_cache_dir().iterdir()) == entries  # nothing new was written


def test_same_size_rewrite_with_mtime_restored_is_recomputed(tmp_path):
    model = _ckpt(tmp_path / "m", SHARDS)
    before = content_id(model)
    shard = model / "model-00002-of-00002.safetensors"
    st = os.stat(shard)
    time.sleep(0.01)  # so the rewrite's ctime is another nanosecond count even on a coarse clock
    with open(shard, "r+b") as f:
        f.write(b"c")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # size and mtime as before; ctime is not
    after = content_id(model)
    assert _hows(after)["model-00002-of-00002.safetensors"] == COMPUTED
    assert _hows(after)["model-00001-of-00002.safetensors"] == REMEMBERED
    assert after.identity != before.identity


def test_the_console_never_reads_a_shard(tmp_path):
    model = _ckpt(tmp_path / "m", SHARDS)
    cid = content_id(model, compute=False)
    assert cid.identity is None and set(_hows(cid).values()) == {UNKNOWN}
    assert not digest_cache_dir().exists()
    assert "not known yet" in cid.summary()


def test_copies_with_other_mtimes_have_one_identity(tmp_path):
    a = _ckpt(tmp_path / "a", SHARDS)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    for p in b.iterdir():
        os.utime(p, (1_000_000, 1_000_000))
    assert content_id(a).identity == content_id(b).identity


def test_hub_blob_digest_is_its_name(tmp_path):
    data = b"z" * 2048
    sha = hashlib.sha256(data).hexdigest()
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / sha).write_bytes(data)
    snap = _ckpt(repo / "snapshots" / "0123abcd", {})
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"t": "s.safetensors"}}))
    (snap / "s.safetensors").symlink_to(Path("../..") / "blobs" / sha)
    [shard] = content_id(snap).shards
    assert (shard.how, shard.sha256, shard.size) == (HUB_BLOB, sha, 2048)
    assert not digest_cache_dir().exists()  # nothing read, nothing to remember


def _hf_metadata(model: Path, name: str, etag: str, stamp: float) -> None:
    meta = model / HF_METADATA_DIR / f"{name}.metadata"
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(f"{'1' * 40}\n{etag}\n{stamp}\n")  # huggingface_hub's write_download_metadata


def test_local_dir_download_metadata_is_trusted_while_the_file_is_unmodified(tmp_path):
    model = _ckpt(tmp_path / "m", SHARDS)
    name = "model-00001-of-00002.safetensors"
    recorded = hashlib.sha256(SHARDS[name]).hexdigest()
    _hf_metadata(model, name, recorded, time.time() + 5)
    assert _hows(content_id(model))[name] == HUB_METADATA
    os.utime(model / name, (time.time() + 60, time.time() + 60))  # modified after the download
    assert _hows(content_id(model))[name] == COMPUTED


def test_a_fifo_shard_is_refused_in_one_line_without_blocking(tmp_path):
    model = _ckpt(tmp_path / "m", SHARDS)
    name = "model-00002-of-00002.safetensors"
    (model / name).unlink()
    os.mkfifo(model / name)
    for compute in (True, False):
        with pytest.raises(UserError) as e:
            content_id(model, compute=compute)
        assert str(e.value) == f"{model / name}: not a regular file (a FIFO); a checkpoint shard must be a file"


def _join(host: str, model: Path) -> str:
    cid = content_id(model)
    return replace(Join.of({"checkpoint": cid.identity, "max_slots": 4}, cid), host=host).line()


def test_disagreement_names_the_shard_and_both_hosts(tmp_path):
    a = _ckpt(tmp_path / "a", SHARDS)
    b = _ckpt(tmp_path / "b", {**SHARDS, "model-00002-of-00002.safetensors": b"B" * 1000})
    assert disagreement([_join("host-a", a), _join("host-b", a)]) is None
    line = disagreement([_join("host-a", a), _join("host-b", b)])
    theirs, ours = hashlib.sha256(b"B" * 1000).hexdigest(), hashlib.sha256(b"b" * 1000).hexdigest()
    assert line == (f"rendezvous: rank 1 on host-b holds a different checkpoint than rank 0 on host-a: shard "
                    f"model-00002-of-00002.safetensors differs (sha256 {theirs[:8]}… vs {ours[:8]}…); "
                    f"start every rank with the same checkpoint and settings")


def test_a_differing_setting_names_the_hosts(tmp_path):
    a = _ckpt(tmp_path / "a", SHARDS)
    lead = Join.from_line(_join("host-a", a))
    other = Join({**lead.parts, "max_slots": 3}, "host-b", lead.config_sha256, lead.weight_map_sha256, lead.shards)
    assert disagreement([lead.line(), other.line()]) == (
        "rendezvous: rank 1 on host-b differs from rank 0 on host-a in max_slots (3 vs 4); "
        "start every rank with the same checkpoint and settings")


def test_events_name_their_host_and_old_lines_still_parse():
    from runtime.events import Emitter, parse

    seen = []
    event = Emitter(seen.append, rank=1).emit("check", "start")
    assert event.host == socket.gethostname() and parse(event.line()).host == socket.gethostname()
    assert parse('{"v":1,"ts":1,"phase":"check","kind":"start","rank":1}').host is None


def test_plan_shows_the_content_identity(tiny_ckpt_ro):
    out = subprocess.run([sys.executable, "-m", "console.cli", "plan", str(tiny_ckpt_ro), "--device", "cpu",
                          "--backend", "eager", "--json"], capture_output=True, text=True, timeout=300)
    content = json.loads(out.stdout)["content"]
    assert content["identity"] and {s["how"] for s in content["shards"]} == {COMPUTED}
    text = subprocess.run([sys.executable, "-m", "console.cli", "plan", str(tiny_ckpt_ro), "--device", "cpu",
                           "--backend", "eager"], capture_output=True, text=True, timeout=300).stdout
    n = len(content["shards"])
    assert f"checkpoint content {content['identity'][:8]}… ({n} shards: {n} remembered)" in text.splitlines()


def test_the_console_plan_uses_remembered_digests_only(tiny_ckpt_ro):
    from runtime.launch.plan import make_plan
    from runtime.launch.spec import LaunchSpec

    plan = make_plan(LaunchSpec(model=tiny_ckpt_ro, device="cpu", backend="eager"))
    assert plan.content["identity"] is None and set(plan.content["counts"]) == {UNKNOWN}
    computed = make_plan(LaunchSpec(model=tiny_ckpt_ro, device="cpu", backend="eager"), digests="compute")
    assert computed.content["identity"] and make_plan(
        LaunchSpec(model=tiny_ckpt_ro, device="cpu", backend="eager")).content["identity"] == \
        computed.content["identity"]


# ---- two ranks over two copies of the checkpoint, as two hosts where this machine allows ----











