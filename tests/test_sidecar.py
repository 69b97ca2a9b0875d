"""Sidecar files: streaming writer, source key, verdicts, one-fd loading, hostile headers, CLI."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys
import textwrap
import tracemalloc
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from console.cli import main as cli
from store import atomic, pagecache, sidecar
from store.errors import UserError
from store.sidecar import MAP, REPACK, TensorPlan

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {"format": "dsv4-packed-test", "packer_version": "t1", "ranks": 2, "layout": {"e": 1}}
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
DTYPES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.int8: "I8", torch.int32: "I32",
    torch.int64: "I64", torch.float16: "F16", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
}  # fmt: skip


@pytest.fixture(autouse=True)
def _state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v4", "hidden_size": 8}))
    save_file({"embed.weight": torch.ones(4, 8)}, d / SHARDS[0])
    save_file({"head.weight": torch.zeros(4, 8)}, d / SHARDS[1])
    index = {"metadata": {}, "weight_map": {"embed.weight": SHARDS[0], "head.weight": SHARDS[1]}}
    (d / sidecar.INDEX_NAME).write_text(json.dumps(index))
    return d


def sample_tensors(fill: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(fill)
    return {
        "layers.w_int8": torch.randint(-128, 127, (3, 5), dtype=torch.int8, generator=g),
        "layers.scale": torch.rand(3, generator=g) + fill,
        "norm.weight": torch.rand(7, generator=g).to(torch.bfloat16),
        "gate.tid2eid": torch.arange(6, dtype=torch.int32).reshape(3, 2) + fill,
        "counts": torch.arange(3, dtype=torch.int64) + fill,
        "half": torch.rand(2, 2, generator=g).to(torch.float16),
        "mask": torch.tensor([True, False, True]),
        "fp8": torch.rand(4, 4, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(float(fill)),
        "empty": torch.zeros(0, 4),
    }


def plan_of(tensors: dict[str, torch.Tensor]) -> list[TensorPlan]:
    return [TensorPlan(n, DTYPES[t.dtype], tuple(t.shape)) for n, t in tensors.items()]


def key_of(model_dir: Path, **overrides):
    return sidecar.source_key(model_dir, **{**SETTINGS, **overrides})


def write(model_dir: Path, path: Path | None = None, tensors=None, stream=None, **kw):
    tensors = sample_tensors() if tensors is None else tensors
    path = path or sidecar.default_sidecar_path(model_dir, SETTINGS["ranks"])
    key = key_of(model_dir)
    extra = kw.pop("extra", {})
    meta = sidecar.sidecar_metadata(key, model_dir, **extra)
    info = sidecar.write_sidecar(
        path, plan_of(tensors), stream if stream is not None else iter(tensors.items()),
        metadata=meta, **kw,
    )  # fmt: skip
    return path, key, info


def assert_equal_tensors(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for n, t in want.items():
        assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
        as_bytes = lambda x: x.reshape(-1).view(torch.uint8)  # noqa: E731 - exact, NaN-safe
        assert torch.equal(as_bytes(got[n]), as_bytes(t)), n


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
        (lambda items: [("wrong", torch.zeros(1)), *items], "not in the plan"),
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
        f"shard:{SHARDS[1]} (mtime_ns {key.as_dict()[f'shard:{SHARDS[1]}']['mtime_ns']} → 1)",
    )


SIGKILL_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from pathlib import Path
    from store import sidecar
    model_dir = Path(sys.argv[1])
    settings = json.loads(sys.argv[2])
    key = sidecar.source_key(model_dir, **settings)
    plan = [sidecar.TensorPlan(f"t{i}", "F32", (256,)) for i in range(4)]

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


# --- verdicts ---------------------------------------------------------------------------------


def test_missing_sidecar_is_repack_missing(model_dir):
    verdict = sidecar.inspect(model_dir / "dsv4-packed.r8.safetensors")
    assert (verdict.action, verdict.reason) == (REPACK, "missing")


def test_hot_current_sidecar_maps_zero_copy_views_of_a_shared_read_only_mapping(model_dir):
    path, key, _ = write(model_dir)
    verdict, mapped = sidecar.open_sidecar(
        path, expected_key=key, expected_names=set(sample_tensors())
    )
    assert (verdict.action, verdict.reason, verdict.residency) == (MAP, "", 1.0)
    with mapped:
        assert_equal_tensors(mapped.tensors, sample_tensors())
        maps = [
            line.split()
            for line in Path("/proc/self/maps").read_text().splitlines()
            if line.endswith(str(path.resolve()))
        ]
        assert [m[1] for m in maps] == ["r--s"]
        lo, hi = (int(x, 16) for x in maps[0][0].split("-"))
        ptr = mapped.tensors["layers.scale"].data_ptr()
        assert lo <= ptr < hi
    assert not any(
        line.endswith(str(path.resolve()))
        for line in Path("/proc/self/maps").read_text().splitlines()
    )


def test_stale_names_the_changed_component(model_dir):
    path, _, _ = write(model_dir)
    verdict = sidecar.inspect(path, expected_key=key_of(model_dir, ranks=4))
    assert (verdict.action, verdict.reason) == (REPACK, "stale")
    assert verdict.changes == ("ranks 2 → 4",)

    (model_dir / "config.json").write_text(json.dumps({"hidden_size": 16}))
    verdict = sidecar.inspect(path)
    assert verdict.reason == "stale" and "config_sha256" in verdict.detail


def test_names_lists_missing_and_extra_tensors(model_dir):
    path, key, _ = write(model_dir)
    expected = (set(sample_tensors()) - {"mask"}) | {"mtp.0.e_proj.weight"}
    verdict = sidecar.inspect(path, expected_key=key, expected_names=expected)
    assert (verdict.action, verdict.reason) == (REPACK, "names")
    assert (
        "1 missing (mtp.0.e_proj.weight)" in verdict.detail and "1 extra (mask)" in verdict.detail
    )


def _cold_sidecar(model_dir, tensors=None):
    # pack_seconds given by the packer: the cold policy compares against this figure.
    path, key, _ = write(model_dir, tensors=tensors, extra={"pack_seconds": "100"})
    return path, key


def _evicted(path):
    """Drop the file from the page cache again (each judgement reads its header back in)."""
    if pagecache.evict(path).fraction > 0.25:
        pytest.skip("this filesystem keeps pages after POSIX_FADV_DONTNEED")
    return path


def test_cold_policy_reject_repacks_and_read_maps(model_dir):
    path, key = _cold_sidecar(model_dir)
    verdict = sidecar.inspect(_evicted(path), expected_key=key, cold_policy="reject")
    assert (verdict.action, verdict.reason) == (REPACK, "cold")
    assert verdict.residency is not None and verdict.residency < 0.9
    assert "threshold" in verdict.detail
    verdict, mapped = sidecar.open_sidecar(_evicted(path), expected_key=key, cold_policy="read")
    with mapped:
        assert (verdict.action, verdict.cold_read) == (MAP, True)
        assert_equal_tensors(mapped.tensors, sample_tensors())


def test_cold_policy_auto_takes_the_predicted_faster_path_and_says_why(model_dir):
    path, key = _cold_sidecar(model_dir)
    default = sidecar.inspect(_evicted(path), expected_key=key)
    assert (
        "default" in default.detail
        and default.read_bytes_per_s == pagecache.DEFAULT_READ_BYTES_PER_S
    )
    assert default.action == MAP  # a few KiB at 500 MB/s beat 100 s of packing

    pagecache.remember_read_throughput(1.0, 1 << 30)  # a disk reading one byte per second
    slow = sidecar.inspect(_evicted(path), expected_key=key)
    assert (slow.action, slow.reason) == (REPACK, "cold")
    assert "auto repacks" in slow.detail and "measured on this host" in slow.detail
    assert slow.predicted_read_s > slow.predicted_pack_s == 100.0

    pagecache.remember_read_throughput(1e12, 1 << 30)
    fast = sidecar.inspect(_evicted(path), expected_key=key)
    assert (fast.action, fast.cold_read) == (MAP, True) and "auto reads it" in fast.detail


def test_every_repack_logs_one_line_and_none_raises(model_dir, caplog):
    path, key, _ = write(model_dir)
    bad = model_dir / "bad.safetensors"
    bad.write_bytes(b"\x01")
    cases = [
        (model_dir / "absent.safetensors", {}),
        (bad, {}),
        (path, {"expected_key": key_of(model_dir, packer_version="t2")}),
        (path, {"expected_key": key, "expected_names": {"only"}}),
    ]
    for target, kw in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="store.sidecar"):
            verdict, mapped = sidecar.open_sidecar(target, **kw)
        assert verdict.action == REPACK and mapped is None
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        assert caplog.records[0].getMessage() == verdict.line()
        assert f"REPACK ({verdict.reason})" in verdict.line()


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


# --- CLI --------------------------------------------------------------------------------------


def test_status_json_reports_verdict_reason_residency_and_size(model_dir, capsys):
    path, _, _ = write(model_dir)
    for target in (path, model_dir):
        assert cli(["sidecar", "status", str(target), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["path"] == str(path) and data["verdict"] == MAP and data["reason"] == ""
        assert 0 <= data["residency"] <= 1 and data["size_bytes"] == path.stat().st_size

    (model_dir / "config.json").write_text("{}")
    assert cli(["sidecar", "status", str(model_dir), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["verdict"], data["reason"]) == (REPACK, "stale")


def test_status_of_a_checkpoint_without_sidecar_is_missing_and_several_need_ranks(
    model_dir, capsys
):
    assert cli(["sidecar", "status", str(model_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reason"] == "missing"
    write(model_dir)
    write(model_dir, path=sidecar.default_sidecar_path(model_dir, 8))
    assert cli(["sidecar", "status", str(model_dir)]) == 1
    err = capsys.readouterr().err.strip()
    assert "pass --ranks" in err and "\n" not in err
    assert cli(["sidecar", "status", str(model_dir), "--ranks", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"].endswith("dsv4-packed.r8.safetensors")


def test_warm_and_evict_commands_move_residency(model_dir, capsys):
    path, _, _ = write(model_dir, tensors={"big": torch.zeros(64, 1024)})
    assert cli(["sidecar", "evict", str(path), "--json"]) == 0
    evicted = json.loads(capsys.readouterr().out)["residency"]
    assert cli(["sidecar", "warm", str(model_dir), "--json"]) == 0
    warmed = json.loads(capsys.readouterr().out)
    assert warmed["after"]["fraction"] == 1.0 and warmed["bytes_read"] == path.stat().st_size
    assert evicted <= 0.25 or pytest.skip("filesystem keeps pages after DONTNEED")
    assert cli(["sidecar", "warm", str(model_dir / "none.safetensors")]) == 1
    assert "no sidecar there" in capsys.readouterr().err


def test_status_and_inspect_never_import_torch(model_dir):
    path, _, _ = write(model_dir)
    code = (
        "import sys; from console.cli import main; "
        f"rc = main(['sidecar', 'status', {str(path)!r}, '--json']); "
        "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO, capture_output=True)
