"""What happened, in sentences: each event says itself, round-trips through JSON, and a host's
services and reachability turn into events as the collector sees them change."""

from __future__ import annotations

import dataclasses

from console_fakes import NOW, snapshot

from console.fleet import events as E
from console.fleet.host import HostReading
from console.fleet.watch import Transitions
from runtime.contract import RankHealth
from store.services import Ending


def _reading(snap, *, reachable=True, error=""):
    return HostReading(host="a", node_rank=0, reachable=reachable, error=error, snapshot=snap, fresh=reachable and not error)


def _with_service(snap, **changes):
    view = snap.services.services[0]
    view = dataclasses.replace(view, **changes)
    return dataclasses.replace(snap, services=dataclasses.replace(snap.services, services=(view,)))


def test_each_event_is_a_sentence_and_a_value_that_travels():
    said = [E.FleetEvent(kind=E.STARTED, action="warm", hosts=("a", "b")),
            E.FleetEvent(kind=E.ENDED, action="warm", hosts=("b",), ok=False, seconds=12.0, text="b: dsv4 exited 1"),
            E.FleetEvent(kind=E.BACK, host="b", seconds=42.0), E.FleetEvent(kind=E.LINE, text="purge: cancelled")]
    assert [e.sentence() for e in said] == ["warm started on a, b", "warm failed on b in 12s: b: dsv4 exited 1",
                                            "b back after 42s", "purge: cancelled"]
    assert [E.FleetEvent.from_json(e.to_json()) for e in said] == said
    early, late = E.FleetEvent(kind=E.STALE, host="a", ts=1.0), E.FleetEvent(kind=E.STALE, host="b", ts=2.0)
    assert E.timeline([late], [early]) == [early, late]  # per host, merged by time


def test_a_service_registering_serving_and_failing_on_another_host_is_said_so():
    snap = snapshot()
    registering = _with_service(snap, detail=dataclasses.replace(snap.services.services[0].detail, status="registering",
                                                                 phase="weights"))
    lost = RankHealth(1, 32, 32, 0, "host-b", 4300, "cpu", "serve", error="no heartbeat for 2.0 s")
    failed = _with_service(snap, detail=dataclasses.replace(
        snap.services.services[0].detail, status="failed", reason="rank 1 on host-b stopped answering",
        ranks=(snap.services.services[0].detail.ranks[0], lost)))
    watch = Transitions()
    said = []
    for s in (registering, snap, failed):
        said += [e.sentence() for e in watch.see((_reading(s),), now=NOW)]
    assert said == ["service registering on a (pid 4242): weights", "service serving http://127.0.0.1:8000 on a (pid 4242)",
                    "service on a failed: rank 1 on host-b stopped answering"]
    unsaid = _with_service(failed, detail=dataclasses.replace(failed.services.services[0].detail, reason=""))
    watch = Transitions()
    watch.see((_reading(snap),), now=NOW)
    [event] = watch.see((_reading(unsaid),), now=NOW)
    assert event.sentence() == "service on a failed: rank 1 on host-b: no heartbeat for 2.0 s" and event.rank == 1


def test_a_service_stopped_or_killed_says_how_and_what_ended_before_is_not_news():
    snap = snapshot()
    view = snap.services.services[0]
    stopped = _with_service(snap, record=dataclasses.replace(view.record, ending=Ending(NOW, "stopped by SIGTERM")))
    killed = _with_service(snap, record=dataclasses.replace(view.record, ending=Ending(
        NOW, "killed by SIGKILL", "serve", "rank 1 lost")))
    assert Transitions().see((_reading(stopped),), now=NOW) == []  # it ended before the console came
    watch = Transitions()
    watch.see((_reading(snap),), now=NOW)
    [event] = watch.see((_reading(stopped),), now=NOW)
    assert event.sentence() == "service on a stopped: stopped by SIGTERM"
    watch = Transitions()
    watch.see((_reading(snap),), now=NOW)
    [event] = watch.see((_reading(killed),), now=NOW)
    assert event.sentence() == "service on a failed: killed by SIGKILL during serve: rank 1 lost"


def test_a_host_stale_then_unreachable_then_back_says_how_long_it_was_away():
    snap, watch = snapshot(), Transitions()
    watch.see((_reading(snap),), now=100.0)
    [stale] = watch.see((_reading(snap, error="no answer for 7 s (last snapshot 7 s ago)"),), now=107.0)
    [gone] = watch.see((_reading(snap, reachable=False, error="connection refused"),), now=110.0)
    [back] = watch.see((_reading(snap),), now=152.0)
    assert [stale.sentence(), gone.sentence(), back.sentence()] == [
        "a stale: no answer for 7 s (last snapshot 7 s ago)", "a unreachable: connection refused", "a back after 42s"]
    connecting = HostReading(host="a", node_rank=0, reachable=False, error="connecting", connecting=True)
    assert Transitions().see((connecting,)) == []  # not an outage: its first answer may still come
