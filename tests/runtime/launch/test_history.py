"""What a launch-history record says: every outcome as it happened, and only launches that
compiled nothing predict the seconds of one that compiles nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from runtime.launch.history import is_warm, plan_settings, recompiled
from runtime.launch.plan import Plan, predict_seconds
from runtime.launch.plan_report import ProgramPlan, SidecarPlan
from runtime.launch.spec import LaunchSpec
from runtime.programs.outcome import Outcome, counts

MODEL = Path("/models/tiny")


def _plan(*states: Outcome, **spec) -> Plan:
    return Plan(LaunchSpec(MODEL, **spec), programs=[ProgramPlan(program=f"p{i}", state=s, fingerprint="f" * 64)
                                                     for i, s in enumerate(states)],
                sidecar=SidecarPlan(path=str(MODEL / "dsv4-packed.r1.safetensors"), verdict="MAP"))


LIKE = plan_settings(_plan())  # what a launch of LaunchSpec(MODEL) records


def _record(programs: dict[str, str], seconds: float, weights: str = "MAP", settings=None, **counts_) -> dict:
    return {**(settings or LIKE), "outcome": "ok", "phases": {
        "programs": {"seconds": seconds, "programs": programs, **({"counts": counts_} if counts_ else {})},
        "weights": {"seconds": 0.2, "path": weights}}}


def test_every_outcome_is_counted_zeros_included():
    assert counts([Outcome.HIT, Outcome.CORRUPT, "HIT"]) == {"HIT": 2, "MISS": 0, "STALE": 0, "CORRUPT": 1,
                                                            "UNTRUSTED": 0, "EAGER": 0}


def test_a_launch_that_replaced_a_corrupt_entry_recompiled():
    # counts of an older dsv4 named HIT/MISS/STALE/EAGER only: the per-program outcomes tell
    corrupt = _record({"a": "CORRUPT", "b": "HIT"}, 9.0, HIT=1, MISS=0, STALE=0, EAGER=0)
    assert recompiled(corrupt) and not is_warm(corrupt)
    hot = _record({"a": "HIT", "b": "HIT"}, 0.1)
    assert not recompiled(hot) and is_warm(hot)
    assert not is_warm(_record({"a": "HIT"}, 0.1, weights="REPACK"))
    assert recompiled({"phases": {"programs": {"counts": {"UNTRUSTED": 1, "HIT": 3}}}})


def test_a_warm_prediction_is_never_based_on_a_launch_that_compiled():
    plan = _plan(Outcome.HIT, Outcome.HIT)
    older_hot = _record({"a": "HIT", "b": "HIT"}, 0.1)
    newer_corrupt = _record({"a": "CORRUPT", "b": "HIT"}, 9.0)
    assert predict_seconds(plan, [older_hot, newer_corrupt])["programs"] == 0.1
    assert plan.basis["programs"] == "history" and plan.compared is not None
    # it recompiles: its peer is the compiling one
    plan.programs[0] = dataclasses.replace(plan.programs[0], state=Outcome.CORRUPT)
    assert predict_seconds(plan, [older_hot, newer_corrupt])["programs"] == 9.0


def test_a_prediction_never_comes_from_an_unlike_launch():
    """An eager launch, another --max-seq, rank count or sidecar use: none predicts this one."""
    plan = _plan(Outcome.HIT)
    unlike = [_record({"a": "HIT"}, 0.02, settings={**LIKE, **change})
              for change in ({"backend": "eager"}, {"max_seq": 512}, {"ranks": 2}, {"sidecar": False},
                             {"model": "/models/other"})]
    unlike.append({k: v for k, v in _record({"a": "HIT"}, 0.02).items() if k != "max_seq"})  # an older record
    predicted = predict_seconds(plan, unlike)
    assert predicted["programs"] is None and plan.basis["programs"] is None and plan.compared is None
    assert predicted["weights"] is None  # the sidecar verdict gives no estimate here either


def test_a_hot_launch_with_no_like_one_is_predicted_from_its_artifact_bytes_and_this_hosts_load_rate():
    plan = _plan(Outcome.HIT, Outcome.HIT)
    plan.programs = [dataclasses.replace(p, size_bytes=3_000_000) for p in plan.programs]
    # the cold launch after which `w` compiled: another model, but the same backend and device,
    # loaded 4 MB in 2 s (what it loaded, not what it compiled)
    cold = {**LIKE, "model": "/models/other", "outcome": "ok", "phases": {"programs": {
        "seconds": 90.0, "programs": {"a": "MISS"}, "load_bytes": 4_000_000, "load_s": 2.0}}}
    assert predict_seconds(plan, [cold])["programs"] == 3.0
    assert plan.basis["programs"] == "model" and plan.compared is None
    other_backend = {**cold, "backend": "export"}
    assert predict_seconds(plan, [other_backend])["programs"] is None  # another backend loads at its own rate


def test_a_launch_that_registered_and_died_later_still_predicts_the_next():
    """Killed after a day of serving: the console's line says so, the phases it took stand."""
    from runtime.launch.history import comparable, likeness, registered
    from store.history import merge

    served = _record({"a": "HIT"}, 0.3)
    served["phases"]["serve"] = {"seconds": 0.05, "url": "http://127.0.0.1:8000"}
    merge(served, {"outcome": "killed", "error": "killed by SIGKILL", "end": "killed by SIGKILL"})
    never = {**_record({"a": "HIT"}, 0.1), "outcome": "error", "error": "kv: not even one slot"}
    plan = _plan(Outcome.HIT)
    assert registered(served) and not registered(never)
    assert comparable([served, never], likeness(plan)) == [served]
    assert predict_seconds(plan, [served, never])["programs"] == 0.3 and plan.compared is not None


def test_each_phase_is_the_slowest_ranks_and_the_span_is_one_formula():
    from runtime.launch.history import launch_seconds, slowest, span

    rank0 = {"check": {"seconds": 0.5}, "programs": {"seconds": 19.12, "counts": {"MISS": 4}},
             "weights": {"seconds": 3.0}, "upload": {"seconds": 0.1}, "kv": {"seconds": 0.2},
             "validate": {"seconds": 1.0}}
    merged = slowest(rank0, {0: {p: r["seconds"] for p, r in rank0.items()}, 1: {"programs": 40.24, "check": 0.4}})
    assert merged["programs"] == {"seconds": 40.24, "counts": {"MISS": 4}, "slowest_rank": 1, "by_rank": [19.12, 40.24]}
    assert merged["check"]["seconds"] == 0.5 and merged["check"]["slowest_rank"] == 0
    assert merged["weights"] == {"seconds": 3.0}  # one rank said it: as it was
    assert span(merged) == round(0.5 + 40.24 + 0.1 + 0.2 + 1.0, 4)  # programs ∥ weights: the longer counts
    assert span({"check": 1.0, "programs": 2.0, "weights": 5.0, "upload": 0.0, "kv": 0.0, "validate": 1.0}) == 7.0
    assert span({"check": 1.0, "programs": None}) is None
    assert launch_seconds({"seconds": 64.92, "phases": merged}) == 64.92  # the whole launch, as recorded
    assert launch_seconds({"phases": {"check": {"seconds": 1.0}, "serve": {"seconds": 0.5}}}) == 1.5  # an older record
