"""Sidecar verdicts (missing, hot, stale, names, the cold policies, one log line per repack) and
the `dsv4 sidecar status / warm / evict` commands that report them."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sidecar_samples import REPO, assert_equal_tensors, key_of, sample_tensors, write
from sidecar_samples import model_dir as model_dir  # a fixture
from sidecar_samples import state_dir as state_dir  # a fixture (autouse)

from console.cli import main as cli
from store import pagecache, sidecar
from store.sidecar import MAP, REPACK

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
    assert verdict.changes == ("ranks is 2 here; this launch uses 4",)

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
