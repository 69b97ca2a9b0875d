"""A fleet's rows, from each host's typed snapshot: the toolchain drift, each rank's progress and
the slowest host, what blocks a launch in its own words, this host's KV beside the service's, an
unreachable host keeping what was last known (with its age), and what a hostile host sends."""

from __future__ import annotations

import dataclasses
import sys
import time

import pytest
from console_fakes import snapshot

from console.data.nodes import NodeView
from console.data.records import LaunchRecord, PhaseRecord
from console.fleet.collector import FleetCollector, FleetSnapshot
from console.fleet.fake import FakeHost
from console.fleet.host import HostReading
from console.fleet.rows import drift, kv_total, rows, slowest
from runtime.launch.plan_report import Problem


def _reading(name: str, rank: int, *, torch: str = "2.13.0", nodes=(), reachable=True, error="", snap=None, age=0.1):
    snap = dataclasses.replace(snap or snapshot(), host_name=name, hostname=name, nodes=tuple(nodes),
                               toolchain={"dsv4": "0.1.0", "torch": torch, "python": "3.11.7", "device": "cpu: x"})
    return HostReading(host=name, node_rank=rank, reachable=reachable, error=error, snapshot=snap, age_s=age,
                       fresh=reachable and not error)


def _node(*ranks):
    return NodeView.from_json({"state": "running", "node_rank": 0, "nnodes": 2, "pid": 7, "create_time": 1.0,
                               "master": "127.0.0.2:29500", "model": "/m", "log": "", "events": "",
                               "ranks": list(ranks)})


def test_drift_names_the_component_and_how_many_others_differ():
    readings = [_reading("a", 0), _reading("b", 1), _reading("c", 2, torch="2.12.1"), _reading("d", 3)]
    assert drift(readings) == {"c": ("torch 2.12.1 here, 2.13.0 on 3 others",)}
    assert drift(readings[:2]) == {}  # two alike: nothing to say
    split = [_reading("a", 0), _reading("b", 1, torch="2.12.1")]  # one each: both are named
    assert drift(split) == {"a": ("torch 2.13.0 here, 2.12.1 on 1 other",),
                            "b": ("torch 2.12.1 here, 2.13.0 on 1 other",)}


def test_a_registering_host_shows_its_ranks_progress_with_an_eta_and_the_slowest_is_named():
    t = 1_800_000_000.0
    fast = _node({"rank": 0, "phase": "kv", "state": "running", "since": t, "ts": t + 1})
    slow = _node({"rank": 1, "phase": "weights", "state": "running", "done": 2, "total": 8, "unit": "layers",
                  "since": t, "ts": t + 10})
    readings = (_reading("a", 0, nodes=[fast]), _reading("b", 1, nodes=[slow]))
    assert slowest(readings) == "slowest: b (weights 2/8)"
    by = {r.host: r for r in rows(FleetSnapshot(t, readings))}
    assert by["b"].phases == "r1 weights 2/8 ETA 30s"  # 2 of 8 in 10 s: 30 s left at that rate
    assert by["a"].phases.startswith("r0 kv")
    assert slowest(readings[:1]) == ""  # one host: nobody is behind


def test_a_row_names_what_blocks_a_launch_there_in_its_own_words():
    snap = snapshot()
    blocked = dataclasses.replace(snap, services=dataclasses.replace(snap.services, services=()),
                                  plan=dataclasses.replace(snap.plan, problems=(Problem(
                                      kind="check",
                                      text="config.json: n_routed_experts=8 is not divisible by ranks=3"),)))
    [row] = rows(FleetSnapshot(0.0, (_reading("c", 2, snap=blocked),)))
    assert row.state == "blocked: check: config.json: n_routed_experts=8 is not divisible by ranks=3" and not row.ok


def test_each_host_shows_its_own_ranks_kv_and_the_top_line_sums_the_service():
    a, b = _reading("a", 0), _reading("b", 1)
    made = rows(FleetSnapshot(0.0, (a, b), left_out=()))
    slots, fits = a.snapshot.device.slots, a.snapshot.device.fits
    assert made[0].slots == slots and f"KV {slots}/" in made[0].device
    assert kv_total(made) == (2 * slots, 2 * fits)
    left = rows(FleetSnapshot(0.0, (a, b), left_out=("b",)))
    assert left[1].left_out and kv_total(left) == (slots, fits)  # a host left out takes no part


def test_an_unreachable_host_keeps_what_was_last_known_marked_with_its_age():
    [row] = rows(FleetSnapshot(0.0, (_reading("gone", 0, reachable=False, error="connection refused", age=42.0),)))
    assert (row.reach, row.ok) == ("✗", False)
    assert row.state.startswith("connection refused — last known 42s ago: serving")
    assert row.programs.startswith("HIT 1") and row.sidecar.startswith("MAP")  # what it last said, not dropped
    never = HostReading(host="new", node_rank=1, reachable=False, error="connection refused")
    assert rows(FleetSnapshot(0.0, (never,)))[0].state == "connection refused"  # nothing known: why, only


def test_a_snapshot_that_parses_but_says_nonsense_is_an_unreadable_row_not_a_crash():
    good = _reading("a", 0)
    bad = dataclasses.replace(good, host="b", snapshot=dataclasses.replace(
        good.snapshot, programs=dataclasses.replace(good.snapshot.programs, entries=(1, 2))))  # not ProgramPlans
    by = {r.host: r for r in rows(FleetSnapshot(0.0, (good, bad)))}
    assert by["a"].reach == "✓" and by["b"].state.startswith("unreadable snapshot (AttributeError")


def test_the_fleets_history_is_one_record_per_launch_across_hosts():
    launch = LaunchRecord(launch="a/100/1.00", started=5.0, outcome="ok", phases={"kv": PhaseRecord(seconds=1.0)})
    later = LaunchRecord(launch="a/100/1.00", started=5.0, outcome="killed", error="rank 1 on b lost")
    other = LaunchRecord(launch="b/200/2.00", started=3.0, outcome="ok")
    hosts = [FakeHost("a", 0, snapshots=[snapshot()], history=[launch]),
             FakeHost("b", 1, snapshots=[snapshot()], history=[later, other])]
    merged = FleetCollector(hosts).history()
    assert [r.launch for r in merged] == ["b/200/2.00", "a/100/1.00"]  # oldest first
    assert merged[1].outcome == "killed" and merged[1].phases == {"kv": PhaseRecord(seconds=1.0)}
    assert merged[0].host == "b"


def _stream_of(program: str):
    """A host whose "ssh" is a local program printing what a hostile host might."""
    from console.fleet.remote import HostStream, SshHost
    from console.fleet.spec import FleetHost
    from console.fleet.ssh import Ssh

    stream = HostStream(SshHost(FleetHost("evil", 0), Ssh()), [sys.executable, "-c", program])
    stream.start()
    deadline = time.monotonic() + 60
    while stream.error == "connecting" and time.monotonic() < deadline:
        time.sleep(0.05)
    return stream


@pytest.mark.parametrize(("line", "says"), [
    ("not json at all", "not a snapshot (JSONDecodeError"),
    ('{"v": 6, "toolchain": [1, 2]}', "not a snapshot (ValueError: toolchain"),
    ('{"v": 99}', "another version of the snapshot: v99 there (a newer dsv4)"),
    ('[1, 2, 3]', "not a dsv4 snapshot (no version)"),
])
def test_what_a_hostile_or_foreign_host_sends_is_a_reading_that_says_so(line, says):
    stream = _stream_of(f"import sys; print({line!r}, flush=True); sys.stdin.read()")
    try:
        reading = stream.reading(time.monotonic())
        assert reading.snapshot is None and says in reading.error and not reading.fresh, reading.error
    finally:
        stream.stop()
