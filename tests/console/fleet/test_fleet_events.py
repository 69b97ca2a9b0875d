"""What happened, in sentences: each event is the timeline's one value (`store.timeline`), says
itself, round-trips through JSON; a host's services and reachability turn into events as the
collector sees them change; what only the console knows goes to this host's timeline file; every
host's timeline merges into one (`gather`), read over each host's connection."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket

from console_fakes import NOW, snapshot

from console.fleet import events as E
from console.fleet.fake import Answer, FakeHost
from console.fleet.host import HostReading
from console.fleet.local import LocalHost
from console.fleet.watch import Transitions
from runtime.contract import RankHealth
from store import timeline as T
from store.services import Ending


def _reading(snap, *, reachable=True, error=""):
    return HostReading(host="a", node_rank=0, reachable=reachable, error=error, snapshot=snap,
                       fresh=reachable and not error)


def _with_service(snap, **changes):
    view = snap.services.services[0]
    view = dataclasses.replace(view, **changes)
    return dataclasses.replace(snap, services=dataclasses.replace(snap.services, services=(view,)))


def test_each_event_is_a_sentence_and_a_value_that_travels():
    said = [T.TimelineEvent(kind=T.STARTED, action="warm", hosts=("a", "b")),
            T.TimelineEvent(kind=T.ENDED, action="warm", hosts=("b",), ok=False, seconds=12.0, text="b: dsv4 exited 1"),
            T.TimelineEvent(kind=T.BACK, host="b", seconds=42.0), T.TimelineEvent(kind=T.LINE, text="purge: cancelled")]
    assert [e.sentence() for e in said] == ["warm started on a, b", "warm failed on b in 12s: b: dsv4 exited 1",
                                            "b back after 42s", "purge: cancelled"]
    assert [T.TimelineEvent.from_json(e.to_json()) for e in said] == said
    early, late = T.TimelineEvent(kind=T.STALE, host="a", ts=1.0), T.TimelineEvent(kind=T.STALE, host="b", ts=2.0)
    assert T.merge([late], [early]) == [early, late]  # per host, merged by time


def test_what_only_the_console_knows_is_kept_in_this_hosts_timeline_by_its_hostname():
    log = E.FleetLog()
    log.say(T.STARTED, action="warm", hosts=("local",))
    log.say(T.STEP, "local", action="warm", text="warm (read)")  # a step stays in the console's log
    log.say(T.UNREACHABLE, "host-b", text="connection refused")
    log.say(T.BACK, "host-b", seconds=42.0)
    log.say(T.ENDED, action="warm", hosts=("local",), ok=True, seconds=3.0)
    kept = T.read()
    me = socket.gethostname()
    assert [e.sentence() for e in kept] == [f"warm started on {me}", "host-b unreachable: connection refused",
                                            "host-b back after 42s", f"warm done on {me} in 3s"]
    assert len(log.events()) == 5  # in memory: every one, the step too


def test_every_hosts_timeline_merges_into_one_read_over_each_connection():
    here = T.TimelineEvent(kind=T.SERVING, host=socket.gethostname(), ts=NOW + 2, url="http://127.0.0.1:8000", pid=7)
    T.append(here)
    there = [T.TimelineEvent(kind=T.FAILED, host="host-b", ts=NOW + t, rank=1, text="rank 1 lost") for t in (1, 3)]
    remote = FakeHost("host-b",
                      script={("events", "--json"): Answer(lines=tuple(json.dumps(e.to_json()) for e in there))})
    away = FakeHost("host-c", script={("events",): Answer(code=255, stderr=("ssh: connect to host-c: refused",))})
    events, problems = asyncio.run(E.gather({"local": LocalHost(), "host-b": remote, "host-c": away}))
    assert events == [there[0], here, there[1]]  # merged by time
    assert remote.commands == [("events", "--json")]  # asked through the host's own funnel
    assert list(problems) == ["host-c"] and "refused" in problems["host-c"]
    assert E.lines(events)[-1].endswith(f"service on host-b failed (rank 1): rank 1 lost (×2 since "
                                        f"{T.Counted(there[0], 1, there[0].ts).line()[:8]})")
    twice, _ = asyncio.run(E.gather({"local": LocalHost(), "copy": FakeHost("copy", script={("events",): Answer(
        lines=(json.dumps(here.to_json()),))})}))
    assert twice == [here]  # two hosts sharing one state directory: each event once


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
    assert said == ["service registering on a (pid 4242): weights",
                    "service serving http://127.0.0.1:8000 on a (pid 4242)",
                    "service on a failed (rank 1): rank 1 on host-b stopped answering"]
    unsaid = _with_service(failed, detail=dataclasses.replace(failed.services.services[0].detail, reason=""))
    watch = Transitions()
    watch.see((_reading(snap),), now=NOW)
    [event] = watch.see((_reading(unsaid),), now=NOW)
    assert (event.sentence() == "service on a failed (rank 1): rank 1 on host-b: no heartbeat for 2.0 s"
            and event.rank == 1)


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
