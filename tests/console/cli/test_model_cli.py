"""`dsv4 synth` / `dsv4 check` as an operator runs them: real processes, exit codes, JSON."""

import json
import os
import subprocess
import sys

import pytest


def dsv4(*args, env=None):
    return subprocess.run([sys.executable, "-m", "console.cli", *map(str, args)],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)


def test_check_ok_json_shape(tiny_ckpt_ro):
    r = dsv4("check", tiny_ckpt_ro, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is True and out["missing"] == [] and out["extra"] == [] and out["mismatched"] == []
    assert out["summary"]["layers"] == 5 and out["summary"]["csa_layers"] == 2


def test_check_human_report(tiny_ckpt_ro):
    r = dsv4("check", tiny_ckpt_ro)
    assert r.returncode == 0
    assert "contract OK" in r.stdout and "2 CSA, 1 HCA" in r.stdout


def test_check_failing_contract_exits_1(tiny_ckpt):
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"]["head.weight"]
    (tiny_ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    r = dsv4("check", tiny_ckpt, "--json")
    assert r.returncode == 1
    assert json.loads(r.stdout)["missing"] == ["head.weight"]
    r = dsv4("check", tiny_ckpt)
    assert r.returncode == 1 and "contract FAILED: 1 missing" in r.stdout


@pytest.mark.parametrize("breakage", ["nodir", "config", "shard"])
def test_bad_input_is_one_line_and_nonzero(tiny_ckpt, tmp_path, breakage):
    target = tiny_ckpt
    if breakage == "nodir":
        target = tmp_path / "missing"
    elif breakage == "config":
        (tiny_ckpt / "config.json").write_text("{")
    else:
        (tiny_ckpt / "model-00002-of-00003.safetensors").write_bytes(b"\x01")
    r = dsv4("check", target)
    assert r.returncode == 1
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("dsv4 check: ")
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_synth_refuses_non_empty_dir(tiny_ckpt):
    r = dsv4("synth", "--preset", "tiny", tiny_ckpt)
    assert r.returncode == 1 and "--force" in r.stderr


@pytest.mark.slow
def test_synth_then_check(tmp_path):
    r = dsv4("synth", "--preset", "tiny", "--shards", "2", "--seed", "3", tmp_path / "m")
    assert r.returncode == 0, r.stderr
    assert "wrote tiny checkpoint" in r.stdout
    assert dsv4("check", tmp_path / "m").returncode == 0


@pytest.mark.slow
def test_check_without_model_creates_embedded_default(tmp_path):
    env = {"DSV4_DATA_DIR": str(tmp_path / "data"), "DSV4_DEFAULT_PRESET": "tiny"}
    r = dsv4("check", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "data" / "models" / "tiny-seed0" / "model.safetensors.index.json").is_file()


@pytest.mark.parametrize(("change", "field"), [
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type"),
    ({"compress_ratios": [0, 0, 4, 16, 8, 0]}, "compress_ratios"),
])
def test_check_refuses_what_the_model_cannot_run_in_one_line(tiny_ckpt, change, field):
    """A rope scaling kind or a compress ratio with no V4 layer type is refused, never run with
    different numerics."""
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    (tiny_ckpt / "config.json").write_text(json.dumps({**cfg, **change}))
    r = dsv4("check", tiny_ckpt)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and f"'{field}'" in r.stderr
