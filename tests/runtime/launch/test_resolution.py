"""Every `auto` decided once, in the plan (issue 70): device, backend, speculative decoding, ready
mode and the ranks a host runs come out of one `Resolution` that the plan carries and `dsv4 plan
--json` prints; config.json is read once per launch and every key hashes those bytes."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from conftest import launch

from runtime.launch.plan import make_plan, resolve
from runtime.launch.plan_report import PlanReport
from runtime.launch.spec import LaunchSpec

opened: list[str] = []  # config.json files opened while `_counting` is on
_counting = [False]


def _audit(event: str, args: tuple) -> None:
    if (_counting[0] and event == "open" and isinstance(args[0], str | Path)
            and os.path.basename(args[0]) == "config.json"):
        opened.append(str(args[0]))


sys.addaudithook(_audit)  # (a hook stays for the process; it records only while a test counts)


def _edited(src: Path, dst: Path, **changes) -> Path:
    """A copy of the checkpoint at `src` whose config.json has `changes` (a value None: dropped)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_the_plan_resolves_every_auto_and_says_so_in_its_report(tiny_ckpt_ro):
    spec = LaunchSpec(tiny_ckpt_ro, device="auto", backend="auto", speculative="auto", ready="auto", max_seq=64)
    report = PlanReport.from_json(json.loads(json.dumps(make_plan(spec).to_json())))
    assert report.device == "cpu" and report.backend in ("aoti", "export")
    assert report.speculative == "off"  # a synthetic checkpoint's random MTP weights draft badly
    assert report.ready == "early"  # programs to compile, one rank: serve on the eager tier at once
    assert report.ranks_here == 1 and not report.problems


def test_speculative_auto_is_on_for_a_real_checkpoint_with_an_mtp_layer(tiny_ckpt_ro, tmp_path):
    real = _edited(tiny_ckpt_ro, tmp_path / "real", dsv4_synthetic=None)
    assert resolve(LaunchSpec(real)).speculative
    assert not resolve(LaunchSpec(real, speculative="off")).speculative
    assert resolve(LaunchSpec(tiny_ckpt_ro, speculative="mtp")).speculative


def test_mtp_asked_of_a_checkpoint_without_the_layer_is_one_problem_of_the_plan(tiny_ckpt_ro, tmp_path):
    ratios = json.loads((tiny_ckpt_ro / "config.json").read_text())["compress_ratios"]
    flat = _edited(tiny_ckpt_ro, tmp_path / "flat", num_nextn_predict_layers=0, compress_ratios=ratios[:-1])
    plan = make_plan(LaunchSpec(flat, speculative="mtp", max_seq=64))
    [problem] = plan.report().problems
    assert problem.kind == "check" and "--speculative mtp" in problem.text and "has no MTP layer" in problem.text
    with pytest.raises(Exception, match="has no MTP layer"):
        plan.resolution.check()


def test_ranks_the_experts_do_not_divide_are_said_once(tiny_ckpt_ro):
    plan = make_plan(LaunchSpec(tiny_ckpt_ro, ranks=3, max_seq=64))
    assert [p.kind for p in plan.report().problems] == ["check"]
    assert "is not divisible by ranks=3" in plan.report().problems[0].text


def test_a_launch_reads_config_json_once_and_serves_what_its_plan_resolved(tiny_ckpt_ro):
    opened.clear()
    _counting[0] = True
    try:
        launched, _ = launch(tiny_ckpt_ro, backend="eager", speculative="mtp")
    finally:
        _counting[0] = False
    try:
        assert opened == [str(tiny_ckpt_ro / "config.json")]
        assert launched.plan.speculative and launched.plan.report().speculative == "mtp"
        assert launched.plan.config.synthetic == "tiny"  # the history record's preset, from that one read
    finally:
        launched.close()
