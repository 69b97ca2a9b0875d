"""The snapshot typed all the way down: a round trip through JSON gives the same values back, a
snapshot the previous schema version wrote (v5, parts as dicts) reads into the same types, and a
newer one is named, never misread."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from console_fakes import snapshot

from console.data.cache import CacheEntry
from console.data.nodes import NodeView
from console.data.records import LaunchRecord
from console.data.snapshot import SCHEMA_VERSION, Snapshot, SnapshotVersionError
from runtime.launch.plan_report import PlanReport, ProgramPlan, RankKv, SidecarPlan
from runtime.programs.outcome import Outcome

V5 = Path(__file__).with_name("snapshot_v5.json")  # what `dsv4 snapshot` of the previous version printed


def _trip(snap: Snapshot) -> Snapshot:
    return Snapshot.from_json(json.loads(json.dumps(snap.to_json())), snap.host_name)


def _without_ages(raw: dict) -> dict:
    """A sidecar's age is computed as it is written: equal values, different seconds."""
    for part in (raw.get("plan") or {}, raw["sidecars"]):
        side = part.get("sidecar") or part.get("wanted")
        if side:
            side.pop("age_seconds", None)
    return raw


def test_a_snapshot_round_trips_through_json_as_the_same_values():
    snap = snapshot()
    back = _trip(snap)
    assert back == snap  # every part, typed: frozen values compare by what they say
    assert _without_ages(json.loads(json.dumps(back.to_json()))) == \
        _without_ages(json.loads(json.dumps(snap.to_json())))


def test_the_previous_versions_snapshot_reads_into_the_same_types():
    raw = json.loads(V5.read_text())
    assert raw["v"] == 5 and isinstance(raw["plan"]["problems"], list) and "sidecars" in raw["sidecars"]
    snap = Snapshot.from_json(raw, "host-a")
    assert snap.host_name == "host-a" and snap.settings.max_seq == 64 and snap.settings.device == "cpu"
    assert isinstance(snap.plan, PlanReport) and all(isinstance(p, ProgramPlan) for p in snap.plan.programs)
    assert {p.state for p in snap.programs.entries} == {Outcome.HIT}  # a warm cache, as the v5 host had it
    assert isinstance(snap.sidecars.wanted, SidecarPlan) and snap.sidecars.wanted.reason == "missing"
    assert snap.sidecars.wanted.next_launch() == "REPACK (missing)" and snap.sidecars.wanted.expected_bytes > 0
    assert all(isinstance(e, CacheEntry) for e in snap.cache.entries) and snap.cache.entries
    assert all(isinstance(b, RankKv) for b in snap.device.budgets) and snap.device.budgets[0].slots == 32
    [node] = snap.nodes
    assert isinstance(node, NodeView) and node.state == "stopped by SIGTERM" and node.node.ending.lines == ("bye",)
    assert node.ranks[0].phase == "weights" and node.ranks[0].done == 2
    [launch] = snap.history
    assert isinstance(launch, LaunchRecord) and launch.outcome == "ok" and launch.phase("programs").path == "HIT 16"
    assert snap.services.services[0].state == "serving" and snap.services.services[0].serving.tokens_s == 182.4
    assert snap.blocking() is None  # a plan with no problem: nothing blocks a launch there
    assert _trip(snap) == snap  # and it writes itself as the current version


def test_a_newer_snapshot_is_named_never_misread():
    raw = snapshot().to_json()
    with pytest.raises(SnapshotVersionError, match=rf"v{SCHEMA_VERSION + 1} there \(a newer dsv4\), "
                                                   rf"v{SCHEMA_VERSION} here"):
        Snapshot.from_json({**raw, "v": SCHEMA_VERSION + 1})
    with pytest.raises(SnapshotVersionError, match="v4 there \\(an older dsv4\\)"):
        Snapshot.from_json({**raw, "v": 4})
