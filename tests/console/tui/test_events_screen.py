"""`e`: what happened, one timeline — in the one-host console this host's timeline file, on the
fleet screen every host's read over its own connection — merged by time, repeats counted, and a
host away says so (fake hosts, a fake snapshot; the timeline files are real)."""

from __future__ import annotations

import json
import time

import pytest
from console_fakes import NOW, fake_app
from test_fleet_screen import _app, _rows, _until

from console.fleet.fake import Answer
from console.tui.screens.events import EventsScreen
from store import timeline as T
from store.timeline import TimelineEvent

pytestmark = pytest.mark.asyncio


def _at(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


async def test_e_in_the_one_host_console_shows_this_hosts_timeline_with_counts():
    for t in (1, 2, 3):
        T.record(T.FAILED, ts=NOW + t, pid=4242, rank=1, text="rank 1 on host-b was killed by SIGKILL")
    T.record(T.SERVING, ts=NOW, pid=4242, url="http://127.0.0.1:8000")
    app = fake_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        await pilot.press("e")
        await _until(pilot, lambda: isinstance(app.screen, EventsScreen) and app.screen.reads, "the events read")
        lines = app.screen.lines()
        assert [line.split(" ", 1)[1] for line in lines] == [
            f"service serving http://127.0.0.1:8000 on {T.host_file().stem} (pid 4242)",
            f"service on {T.host_file().stem} failed (rank 1): rank 1 on host-b was killed by SIGKILL "
            f"(×3 since {_at(NOW + 1)})"]
        await pilot.press("slash", *"kill")
        await pilot.pause()
        assert len(app.screen.lines()) == 1
        await pilot.press("escape", "escape")
        await pilot.pause()
        assert not isinstance(app.screen, EventsScreen)


async def test_e_on_the_fleet_screen_merges_every_hosts_timeline_and_names_a_host_away():
    app, hosts = _app()
    stale = TimelineEvent(kind=T.STALE, host="host-c", ts=NOW + 5, text="no answer for 7 s")
    back = TimelineEvent(kind=T.BACK, host="host-c", ts=NOW + 9, seconds=4.0)
    hosts["host-a"].script[("events",)] = Answer(lines=(json.dumps(TimelineEvent(
        kind=T.SERVING, host="host-a", ts=NOW + 1, url="http://10.0.0.1:8000", pid=9).to_json()),))
    hosts["host-b"].script[("events",)] = Answer(code=255, stderr=("ssh: connect to host host-b: Connection refused",))
    for e in (stale, back):
        T.append(e, T.host_file())  # what this console saw of host-c, kept in this host's timeline
    async with app.run_test(size=(200, 50)) as pilot:
        await _rows(pilot, app)
        await pilot.press("e")
        await _until(pilot, lambda: isinstance(app.screen, EventsScreen) and app.screen.reads, "the events read")
        screen = app.screen
        assert [line.split(" ", 1)[1] for line in screen.lines()] == [
            "service serving http://10.0.0.1:8000 on host-a (pid 9)", "host-c stale: no answer for 7 s",
            "host-c back after 4s"]
        assert list(screen.problems) == ["host-b"] and "Connection refused" in screen.problems["host-b"]
        assert hosts["host-a"].commands[-1] == ("events", "--json")
