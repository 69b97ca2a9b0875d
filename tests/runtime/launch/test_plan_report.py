"""The plan as a value that travels: typed parts, a JSON round trip, version 1 still read, a
newer version named (runtime.launch.plan_report)."""

from __future__ import annotations

import json

import pytest

from runtime.launch.plan import make_plan
from runtime.launch.plan_report import REPORT_VERSION, PlanReport, Problem, ReportVersionError
from runtime.launch.spec import LaunchSpec
from runtime.programs.outcome import Outcome


def _report(model, cache) -> PlanReport:
    return make_plan(LaunchSpec(model, kernel_cache_dir=cache, backend="export", device="cpu", max_seq=64),
                     history=[]).report()


def test_a_plan_report_round_trips_through_json_as_typed_parts(tiny_ckpt_ro, tmp_path):
    report = _report(tiny_ckpt_ro, tmp_path / "kc")
    raw = json.loads(json.dumps(report.to_json()))
    back = PlanReport.from_json(raw)
    assert back.to_json() == \
        {**raw, "sidecar": {**raw["sidecar"], "age_seconds": back.to_json()["sidecar"]["age_seconds"]}}
    assert {p.state for p in back.programs} == {Outcome.MISS} and back.programs[0].state is Outcome.MISS
    assert back.sidecar.verdict == "REPACK" and back.sidecar.reason == "missing" and back.sidecar.expected_bytes > 0
    assert back.kv.slots == sum(r.slots for r in back.kv.per_rank) >= 1
    assert back.spec == report.spec and back.like == report.like
    assert raw["v"] == REPORT_VERSION


def test_problems_are_a_kind_and_a_sentence_and_version_1_lines_still_read(tiny_ckpt, tmp_path):
    (tiny_ckpt / "config.json").write_text("{not json")
    report = _report(tiny_ckpt, tmp_path / "kc")
    assert report.blocking() is not None and report.blocking().kind == "check"
    old = {**report.to_json(), "problems": ["check: config.json: broken", "kv: not even one KV slot fits"]}
    del old["v"]  # version 1 wrote no version
    back = PlanReport.from_json(old)
    assert back.problems == (Problem(kind="check", text="config.json: broken"),
                             Problem(kind="kv", text="not even one KV slot fits"))
    with pytest.raises(ReportVersionError, match=f"version {REPORT_VERSION + 1}"):
        PlanReport.from_json({**report.to_json(), "v": REPORT_VERSION + 1})
