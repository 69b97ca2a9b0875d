"""bench/accelerator.sh, the prepared run for a GPU host (issue 28), run here on the cpu so that
it cannot rot: the same script, the same steps, the tiny preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO as ROOT

from bench.accelerator_bench import PROMPTS, compare_greedy


@pytest.mark.slow
def test_the_accelerator_run_works_end_to_end_on_the_cpu(tmp_path):
    out = tmp_path / "results"
    r = subprocess.run([str(ROOT / "bench" / "accelerator.sh"), str(out), "--device", "cpu", "--preset", "tiny",
                        "--backend", "export", "--loads", "1,3", "--greedy-tokens", "6"],
                       env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "greedy vs cpu eager: equal True" in (out / "log.txt").read_text()
    result = json.loads((out / "accelerator.json").read_text())
    assert result["device"] == "cpu" and result["machine"]["torch"]
    f = result["presets"]["tiny"]
    cold, hot = f["cold"], f["hot"]
    assert cold["weights"] == "REPACK" and cold["programs"]["MISS"] == sum(cold["programs"].values()) > 0
    assert hot["weights"] == "MAP" and hot["programs"]["HIT"] == sum(hot["programs"].values())
    assert hot["phases"]["upload"]["zero_copy"] and hot["upload_gb_per_s"] is None  # cpu: nothing moves
    kv = hot["phases"]["kv"]
    assert kv["slots"] == 64 and kv["fits"] >= 64 and kv["total_bytes"] == f["memory_before"]["devices"][0]["total"]
    console = f["console"]
    assert console["total_equal"] and console["slot_bytes_equal"] and console["pane"]["source"] == "meminfo"
    greedy = f["greedy"]
    assert greedy["equal"] and greedy["equal_or_within_tolerance"] and len(greedy["prompts"]) == len(PROMPTS)
    assert all(p["tokens"] == 6 for p in greedy["prompts"])
    assert set(f["decode"]) == {"1", "3"}
    assert all(d["tokens"] > 0 and d["tokens_per_s"] > 0 for d in f["decode"].values())
    assert "upload" not in f  # the staging-buffer comparison needs an accelerator
    for name in ("memory_before", "memory_serving", "memory_after"):
        assert f[name]["devices"][0]["total"] > 0


@pytest.mark.slow  # a whole launch through the bench's child process: ~6 s
def test_a_run_that_fails_keeps_what_it_measured_and_says_why(tmp_path):
    """No NPU here: the cold launch fails; the figures hold the synthesis, the memory reading
    (npu-smi absent, in one line) and the launch's own error, and the exit status is 1."""
    out = tmp_path / "results"
    r = subprocess.run([str(ROOT / "bench" / "accelerator.sh"), str(out), "--device", "npu", "--preset", "tiny,small"],
                       env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    result = json.loads((out / "accelerator.json").read_text())
    assert list(result["presets"]) == ["tiny"]  # the next preset would fail the same way: not tried
    f = result["presets"]["tiny"]
    assert f["synth_s"] > 0 and f["memory_before"]["error"] and "cold" not in f
    assert "torch_npu" in f["error"]
    assert "FAILED" in (out / "log.txt").read_text()


def test_a_work_directory_it_did_not_make_is_never_replaced(tmp_path):
    theirs = tmp_path / "work" / "tiny"
    theirs.mkdir(parents=True)
    (theirs / "keep.txt").write_text("someone's")
    r = subprocess.run([str(ROOT / "bench" / "accelerator.sh"), str(tmp_path / "out"), "--device", "cpu",
                        "--preset", "tiny", "--work", str(tmp_path / "work")],
                       env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and (theirs / "keep.txt").read_text() == "someone's"
    error = json.loads((tmp_path / "out" / "accelerator.json").read_text())["presets"]["tiny"]["error"]
    assert "is not this bench's own work directory" in error


def _row(tokens, logprobs, gaps=None):
    return {"tokens": tokens, "logprobs": logprobs, "gaps": gaps or [1.0] * len(tokens)}


def test_greedy_comparison_names_the_first_divergent_position_and_whether_it_was_a_near_tie():
    same = compare_greedy([_row([1, 2, 3], [-0.1, -0.2, -0.3])], [_row([1, 2, 3], [-0.1, -0.2005, -0.3])])
    assert same["equal"] and same["equal_or_within_tolerance"]
    assert same["max_abs_logprob_diff"] == pytest.approx(5e-4)

    tie = compare_greedy([_row([1, 2, 3], [-0.1, -0.69, -0.3], [0.5, 0.001, 0.5])],
                         [{"tokens": [1, 7, 9], "logprobs": [-0.1, -0.7, -0.2]}])
    p = tie["prompts"][0]
    assert not tie["equal"] and tie["equal_or_within_tolerance"]  # the runner-up was 0.001 behind
    assert (p["first_divergent_position"], p["reference_token"], p["device_token"]) == (1, 2, 7)
    assert tie["max_abs_logprob_diff"] == pytest.approx(0.0)  # over the tokens both chose

    wide = compare_greedy([_row([1, 2], [-0.1, -0.2], [0.5, 3.0])], [{"tokens": [1, 5], "logprobs": [-0.1, -4.0]}])
    assert not wide["equal_or_within_tolerance"]  # a 3-nat gap overturned: not floats

    drift = compare_greedy([_row([1, 2], [-0.1, -0.2])], [{"tokens": [1, 2], "logprobs": [-0.1, -0.5]}])
    assert drift["equal"] and not drift["equal_or_within_tolerance"]  # same tokens, logits too far apart
