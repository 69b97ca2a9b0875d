"""Sidecar loading: one descriptor per load, so a file replaced mid-load or by a racing process
is seen whole; and hostile headers judged corrupt without a crash or a large allocation."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import tracemalloc

import pytest
import torch
from safetensors import safe_open
from sidecar_samples import assert_equal_tensors, sample_tensors, write
from sidecar_samples import model_dir as model_dir  # a fixture
from sidecar_samples import state_dir as state_dir  # a fixture (autouse)

from store import pagecache, sidecar
from store.sidecar import MAP, REPACK

# --- one descriptor per load ------------------------------------------------------------------


def test_a_file_replaced_mid_load_never_mixes_old_and_new(model_dir, tmp_path, monkeypatch):
    path, key, _ = write(model_dir, tensors=sample_tensors(1), extra={"generation": "1"})
    newer, _, _ = write(
        model_dir, path=tmp_path / "newer.safetensors", tensors=sample_tensors(2),
        extra={"generation": "2"},
    )  # fmt: skip
    real = pagecache.residency

    def replace_then_probe(fd, **kw):  # runs after open, before header, validation and mmap
        os.replace(newer, path)
        return real(fd, **kw)

    monkeypatch.setattr(pagecache, "residency", replace_then_probe)
    verdict, mapped = sidecar.open_sidecar(path, expected_key=key)
    monkeypatch.setattr(pagecache, "residency", real)
    assert verdict.action == MAP
    with mapped:
        assert mapped.metadata["generation"] == "1"
        assert_equal_tensors(mapped.tensors, sample_tensors(1))
    _, fresh = sidecar.open_sidecar(path, expected_key=key)
    with fresh:
        assert fresh.metadata["generation"] == "2"
        assert_equal_tensors(fresh.tensors, sample_tensors(2))


REPLACER_CHILD = textwrap.dedent(
    """
    import os, shutil, sys
    target, a, b, stop = sys.argv[1:]
    i = 0
    while not os.path.exists(stop):
        src = (a, b)[i % 2]
        tmp = f"{target}.tmp-replacer"
        shutil.copyfile(src, tmp)
        os.replace(tmp, target)
        i += 1
    """
)


def test_loads_racing_a_replacing_process_each_see_one_whole_file(model_dir, tmp_path):
    path, key, _ = write(model_dir, tensors=sample_tensors(1), extra={"generation": "1"})
    copies = []
    for g in (1, 2):
        p, _, _ = write(
            model_dir, path=tmp_path / f"gen{g}.safetensors", tensors=sample_tensors(g),
            extra={"generation": str(g)},
        )  # fmt: skip
        copies.append(str(p))
    stop = tmp_path / "stop"
    child = subprocess.Popen([sys.executable, "-c", REPLACER_CHILD, str(path), *copies, str(stop)])
    generations = set()
    try:
        for _ in range(40):
            verdict, mapped = sidecar.open_sidecar(path, expected_key=key, cold_policy="read")
            assert verdict.action == MAP, verdict.line()
            with mapped:
                g = int(mapped.metadata["generation"])
                assert_equal_tensors(mapped.tensors, sample_tensors(g))
                generations.add(g)
    finally:
        stop.touch()
        child.wait()
    assert generations <= {1, 2}


# --- hostile headers --------------------------------------------------------------------------


def _craft(entries: dict, metadata: dict, data: bytes, *, length: int | None = None) -> bytes:
    body = json.dumps({"__metadata__": metadata, **entries}).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def _valid_metadata(model_dir) -> dict:
    path, _, _ = write(model_dir, tensors={"a": torch.zeros(2)})
    with safe_open(path, "pt") as f:
        return f.metadata()


def _f32(offsets, shape=(2,), dtype="F32"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


HOSTILE = {
    "truncated": (lambda m: b"\x10\x00\x00", "shorter than the 8-byte"),
    "huge-length": (lambda m: struct.pack("<Q", 2**63) + b"{}", "exceeds"),
    "length-past-end": (lambda m: _craft({}, m, b"", length=4096), "past the end of the file"),
    "not-json": (lambda m: struct.pack("<Q", 4) + b"{{{{", "not valid JSON"),
    "offset-past-end": (lambda m: _craft({"a": _f32([0, 8])}, m, b"\0" * 4), "past the end"),
    "overlapping": (
        lambda m: _craft({"a": _f32([0, 8]), "b": _f32([4, 12])}, m, b"\0" * 12),
        "overlap",
    ),
    "dtype-shape-mismatch": (
        lambda m: _craft({"a": _f32([0, 8], shape=(4,))}, m, b"\0" * 8),
        "needs 16 bytes",
    ),
    "huge-shape": (
        lambda m: _craft({"a": _f32([0, 8], shape=(2**40, 2**40))}, m, b"\0" * 8),
        "needs",
    ),
    "unknown-dtype": (lambda m: _craft({"a": _f32([0, 8], dtype="F128")}, m, b"\0" * 8), "dtype"),
    "gap": (lambda m: _craft({"a": _f32([4, 12])}, m, b"\0" * 12), "gap"),
    "trailing": (lambda m: _craft({"a": _f32([0, 8])}, m, b"\0" * 16), "trailing"),
    "negative-offset": (lambda m: _craft({"a": _f32([-8, 0])}, m, b"\0" * 8), "not ordered"),
    "metadata-not-strings": (
        lambda m: _craft({}, {**m, "ranks": 2}, b""),
        "not an object of strings",
    ),
    "metadata-missing": (
        lambda m: _craft({}, {k: v for k, v in m.items() if k != "source_key"}, b""),
        "lacks source_key",
    ),
    "fingerprint-mismatch": (
        lambda m: _craft({}, {**m, "source_fingerprint": "0" * 64}, b""),
        "not the fingerprint",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_header_is_repack_corrupt_without_crash_or_large_allocation(model_dir, case):
    build, message = HOSTILE[case]
    path = model_dir / "hostile.safetensors"
    path.write_bytes(build(_valid_metadata(model_dir)))
    tracemalloc.start()
    try:
        verdict, mapped = sidecar.open_sidecar(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (verdict.action, verdict.reason, mapped) == (REPACK, "corrupt", None)
    assert message in verdict.detail
    assert peak < 1 << 20


def test_duplicate_tensor_names_are_corrupt(model_dir):
    meta = json.dumps(_valid_metadata(model_dir))
    body = (
        f'{{"__metadata__":{meta},"a":{json.dumps(_f32([0, 8]))},"a":{json.dumps(_f32([8, 16]))}}}'
    )
    path = model_dir / "dup.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body.encode() + b"\0" * 16)
    verdict = sidecar.inspect(path)
    assert verdict.reason == "corrupt" and "names 'a' twice" in verdict.detail


