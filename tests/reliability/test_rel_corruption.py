"""Property-based corruption (hypothesis, derandomized): manifest JSON, artifact bytes, sidecar
headers and metadata, config.json, the index and shard headers. Never an unhandled exception,
never a wrong tensor or program served; each detected case is a MISS, a REPACK or a clear error.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from relcounts import record

from store.fingerprint import Key
from store.kernel_cache import MANIFEST, Hit, KernelCache
from store.kernel_cache.inventory import inventory

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
PAYLOAD = b"compiled program " * 256
KEY = Key.of({"backend": "export", "source:p": "1", "torch": "2.13.0"})
COUNTS: dict[str, dict[str, int]] = {}


def _count(name: str, outcome: str) -> None:
    COUNTS.setdefault(name, {"trials": 0, "recovered": 0, "clean_error": 0, "data_lost": 0})
    COUNTS[name]["trials"] += 1
    COUNTS[name][outcome] += 1


@pytest.fixture(scope="module", autouse=True)
def _report(tmp_path_factory):
    yield
    for name, c in COUNTS.items():
        record(tmp_path_factory, f"corruption: {name}", injection="hypothesis byte/JSON mutations, seed derandomized",
               trials=c["trials"], recovered=c["recovered"], clean_error=c["clean_error"], data_lost=c["data_lost"],
               note="recovered = mutation harmless and exact data served; clean_error = MISS/REPACK/clear error")


mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, 255)),
)


def mutate(data: bytes, m, limit: int | None = None) -> bytes:
    kind, pos, val = m
    n = limit if limit is not None else len(data)
    pos = pos % max(n, 1)
    if kind == "flip":
        return data[:pos] + bytes([data[pos] ^ val]) + data[pos + 1 :]
    if kind == "truncate":
        return data[:pos]
    return data[:pos] + bytes([val]) + data[pos:]


json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                          lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                          max_leaves=6)


def _fresh_cache(tmp: Path) -> tuple[KernelCache, Path]:
    if tmp.exists():
        shutil.rmtree(tmp)
    cache = KernelCache(tmp)
    hit = cache.publish("prog", KEY, {"program.pt2": PAYLOAD})
    return cache, hit.path


def _judge_lookup(cache: KernelCache, name: str) -> None:
    got = cache.lookup("prog", KEY)  # must not raise
    inventory(cache.layout)
    if isinstance(got, Hit):
        ok = got.data("program.pt2") == PAYLOAD
        _count(name, "recovered" if ok else "data_lost")
        assert ok, "a HIT served other bytes"
    else:
        assert got.kind in ("corrupt", "absent", "stale"), got
        _count(name, "clean_error")


@SETTINGS
@given(m=mutation)
def test_manifest_bytes(tmp_path_factory, m):
    cache, entry = _fresh_cache(tmp_path_factory.getbasetemp() / "corrupt-manifest")
    raw = (entry / MANIFEST).read_bytes()
    (entry / MANIFEST).write_bytes(mutate(raw, m))
    _judge_lookup(cache, "manifest JSON bytes")


@SETTINGS
@given(field=st.sampled_from(["format", "program", "fingerprint", "key", "config_components", "files",
                              "compile_seconds", "created", "host", "pid"]), value=json_value)
def test_manifest_fields(tmp_path_factory, field, value):
    cache, entry = _fresh_cache(tmp_path_factory.getbasetemp() / "corrupt-fields")
    data = json.loads((entry / MANIFEST).read_bytes())
    data[field] = value
    (entry / MANIFEST).write_text(json.dumps(data))
    _judge_lookup(cache, "manifest JSON fields")


@SETTINGS
@given(m=mutation)
def test_artifact_bytes(tmp_path_factory, m):
    cache, entry = _fresh_cache(tmp_path_factory.getbasetemp() / "corrupt-artifact")
    art = entry / "program.pt2"
    art.write_bytes(mutate(art.read_bytes(), m))
    _judge_lookup(cache, "artifact bytes")


# --- sidecar ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def packed(tiny_ckpt_ro, tmp_path_factory):
    from runtime.weights.prepack import packed_layout, prepack, sidecar_key
    from store import sidecar

    ckpt = tmp_path_factory.mktemp("corrupt-sidecar") / "ckpt"
    shutil.copytree(tiny_ckpt_ro, ckpt)
    info = prepack(ckpt)
    raw = info.path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    _, mapped = sidecar.open_sidecar(info.path, expected_key=sidecar_key(ckpt, 1),
                                           expected_names=packed_layout(ckpt, 1).names(), cold_policy="read")
    ref = {k: _tensor_sha(v)
           for k, v in mapped.tensors.items()}
    mapped.close()
    return ckpt, info.path, raw, n, ref, sidecar_key(ckpt, 1), packed_layout(ckpt, 1).names()


def _tensor_sha(t) -> str:
    import torch

    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _judge_sidecar(packed, data: bytes, name: str) -> None:
    from store import sidecar

    _, path, raw, _, ref, key, names = packed
    try:
        path.write_bytes(data)
        verdict, mapped = sidecar.open_sidecar(path, expected_key=key, expected_names=names, cold_policy="read")
        if mapped is None:
            assert verdict.action == "REPACK" and verdict.reason
            _count(name, "clean_error")
            return
        got = {k: _tensor_sha(v) for k, v in mapped.tensors.items()}
        mapped.close()
        ok = got == ref
        _count(name, "recovered" if ok else "data_lost")
        assert ok, "MAP served tensors that differ from what was packed"
    finally:
        path.write_bytes(raw)


@SETTINGS
@given(m=mutation)
def test_sidecar_header_bytes(packed, m):
    raw, n = packed[2], packed[3]
    _judge_sidecar(packed, mutate(raw, m, limit=8 + n), "sidecar header bytes")


@SETTINGS
@given(i=st.integers(0, 10**6), j=st.integers(0, 10**6), meta_key=st.text(max_size=12), meta_val=json_value,
       op=st.sampled_from(["swap_offsets", "metadata", "shape"]))
def test_sidecar_header_structure(packed, i, j, meta_key, meta_val, op):
    """Well-formed headers that lie: swapped offsets, changed metadata, reshaped tensors."""
    raw, n = packed[2], packed[3]
    header = json.loads(raw[8 : 8 + n])
    names = sorted(k for k in header if k != "__metadata__")
    if op == "swap_offsets":
        a, b = names[i % len(names)], names[j % len(names)]
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    elif op == "metadata":
        meta = header["__metadata__"]
        k = sorted(meta)[i % len(meta)] if meta_key == "" else meta_key
        meta[k] = json.dumps(meta_val) if j % 2 else str(meta_val)
    else:
        a = names[i % len(names)]
        header[a]["shape"] = list(reversed(header[a]["shape"]))
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    if len(body) != n:  # keep the data region where it was: pad or skip
        if len(body) > n:
            _count("sidecar header structure", "clean_error")
            return
        body += b" " * (n - len(body))
    _judge_sidecar(packed, struct.pack("<Q", n) + body + raw[8 + n :], "sidecar header structure")


# --- checkpoint: config.json, index, shard headers ---------------------------------------------


@pytest.fixture(scope="module")
def ckpt_copy(tiny_ckpt_ro, tmp_path_factory):
    d = tmp_path_factory.mktemp("corrupt-ckpt") / "ckpt"
    shutil.copytree(tiny_ckpt_ro, d)
    return d


def _open_checkpoint(d: Path, name: str) -> None:
    from runtime.model.config import ConfigError, load_config
    from store.checkpoint import Checkpoint, CheckpointError
    from store.errors import UserError

    try:
        load_config(d)
        with Checkpoint.open(d) as ckpt:
            for n in ckpt.names()[:3]:
                ckpt.read(n)
    except (ConfigError, CheckpointError, UserError) as e:
        assert str(e) and "\n" not in str(e)
        _count(name, "clean_error")
        return
    _count(name, "recovered")


@SETTINGS
@given(m=mutation, which=st.sampled_from(["config.json", "model.safetensors.index.json", "shard"]))
def test_checkpoint_files(ckpt_copy, m, which):
    if which == "shard":
        path = sorted(ckpt_copy.glob("model-*.safetensors"))[0]
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        data = mutate(raw, m, limit=8 + n)
    else:
        path = ckpt_copy / which
        raw = path.read_bytes()
        data = mutate(raw, m)
    try:
        path.write_bytes(data)
        _open_checkpoint(ckpt_copy, f"checkpoint {which if which != 'shard' else 'shard header'}")
    finally:
        path.write_bytes(raw)


def test_sidecar_swapped_offsets_of_same_shape_tensors_are_not_served(packed):
    raw, n = packed[2], packed[3]
    header = json.loads(raw[8 : 8 + n])
    by_shape: dict = {}
    for k, v in header.items():
        if k != "__metadata__":
            by_shape.setdefault((v["dtype"], tuple(v["shape"])), []).append(k)
    a, b = next(v for v in by_shape.values() if len(v) > 1)[:2]
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (n - len(body))
    _judge_sidecar(packed, struct.pack("<Q", n) + body + raw[8 + n :], "sidecar swapped same-shape offsets")
