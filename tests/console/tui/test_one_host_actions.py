"""The one-host console is a fleet of one: `l`, `s`, `d` and the first run's `create` are the
fleet's actions, run by its runner through the host's funnel (a fake host here, recording every
command): a launch is `dsv4 service start` (detached under its supervisor) and the console attaches
to the service by the record it prints; a stop is `dsv4 service stop PID`; the Registration pane
says what the next launch waits for while the default checkpoint is created, and stops saying it
once it is (issue 71: it kept saying so until the console restarted)."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import psutil
import pytest
from console_fakes import SPEC, snapshot

from console.data.services import ServicesSnapshot, ServiceView
from console.fleet.fake import Answer, FakeHost
from console.tui.app import Dsv4Console
from console.tui.screens.confirm import ConfirmScreen
from runtime.events import Event
from store import services
from store import timeline as T

pytestmark = pytest.mark.asyncio


def _this_process_as_a_service() -> services.Service:
    """A registry record whose identity is this very process: `running` for as long as the test."""
    me = psutil.Process()
    return services.Service(os.getpid(), me.create_time(), tuple(me.cmdline()), str(SPEC.model), services.SERVING,
                            "http://127.0.0.1:8123", log="", events="", log_file="/state/services/logs/serve-8123.log")


async def _until(pilot, done, what: str) -> None:
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await pilot.pause(0.05)


async def test_launch_runs_service_start_through_the_funnel_attaches_and_stop_is_service_stop():
    service = _this_process_as_a_service()
    empty = dataclasses.replace(snapshot(), services=ServicesSnapshot())
    serving = dataclasses.replace(snapshot(), services=ServicesSnapshot((ServiceView(service, "ok"),)))
    host = FakeHost("this", snapshots=[empty], script={
        ("service", "start"): Answer(lines=(json.dumps(service.to_json()),)),
        ("service", "stop"): Answer.record(pid=service.pid, now="stopped by SIGTERM")})
    app = Dsv4Console(SPEC, host=host, watch=False, create_default=False, interval=0)
    async with app.run_test(size=(180, 50)) as pilot:
        await pilot.pause()
        await pilot.press("l")
        await _until(pilot, lambda: app.service is not None, "attached to the service it started")
        [start] = host.commands
        assert start[:3] == ("service", "start", "--json") and str(SPEC.model) in start and "--events" not in start
        assert app.service.pid == service.pid and app.service.running and app.launch is not None
        assert app.launch.spawned == service.create_time  # the whole launch counts from its process's start
        said = [e.sentence() for e in app.session.log.events()]
        assert "launch started on this" in said and any(s.startswith("launch on this: service up: pid ") for s in said)
        await pilot.press("l")  # a second `l` while it runs: refused, nothing run
        await pilot.pause()
        assert len(host.commands) == 1
        host.snapshots[0] = serving
        app.refresh_now()
        await pilot.pause()
        app.query_one("#services-table").focus()
        await pilot.press("s")
        await _until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the stop question")
        assert "started by this console" in app.screen.body
        await pilot.press("y")
        await _until(pilot, lambda: len(host.commands) == 2, "the stop")
        assert host.commands[1] == ("service", "stop", str(service.pid), "--timeout", "10", "--json")
        await _until(pilot, lambda: "stopped by SIGTERM" in app.status, "the stop said")
    kept = [e.sentence() for e in T.read()]  # the console's actions, in this host's timeline
    assert [s.split(" on ")[0] for s in kept] == ["launch started", "launch done", "stop started", "stop done"]


async def test_a_launch_that_cannot_start_says_why_and_holds_nothing():
    host = FakeHost("this", snapshots=[dataclasses.replace(snapshot(), services=ServicesSnapshot())], script={
        ("service", "start"): Answer(code=1, stderr=("dsv4 service start: the service did not start: "
                                                     "port 8000 is in use",))})
    app = Dsv4Console(SPEC, host=host, watch=False, create_default=False, interval=0)
    async with app.run_test(size=(180, 50)) as pilot:
        await pilot.pause()
        await pilot.press("l")
        await _until(pilot, lambda: app.launch is not None and app.launch.ended, "the failed start")
        assert app.service is None and "port 8000 is in use" in app.launch.ended
        summary = str(app.query_one("#registration-summary").render())
        assert "did not start" in summary and "serving" not in summary


async def test_create_is_an_action_and_registration_stops_waiting_once_it_is_done():
    progress = [Event("create", "progress", done=d, total=6 << 20, unit="bytes").line() for d in (3 << 20, 6 << 20)]
    host = FakeHost("this", snapshots=[snapshot()], script={("check",): Answer(lines=tuple(progress), delay=0.6)})
    app = Dsv4Console(SPEC, host=host, watch=False, create_default=False, interval=0)
    async with app.run_test(size=(180, 50)) as pilot:
        await pilot.pause()
        await app.run_action("mutate('create')")
        await _until(pilot, lambda: "create" in app.jobs_control.running(), "the creation running")
        app.show_registration()
        waiting = str(app.query_one("#registration-table").get_row_at(1)[5])
        summary = str(app.query_one("#registration-summary").render())
        await _until(pilot, lambda: "create" not in app.jobs_control.running() and not app.progress,
                     "the creation done")
        await pilot.pause()
        after = str(app.query_one("#registration-table").get_row_at(1)[5])
        summary_after = str(app.query_one("#registration-summary").render())
    assert host.commands == [("check", "--events", "-")]
    assert "waits for the checkpoint being created" in waiting and "creating the default" in summary
    assert "waits for" not in after and "creating the default" not in summary_after


async def test_a_sweeps_gone_gives_way_to_the_supervisors_cause(tmp_path):
    """A registry sweep may see the dead pid before its supervisor records the signal: the console
    waits for the witness, so the header says `killed by SIGKILL during serve`, not `gone`."""
    import asyncio
    import signal
    import subprocess
    import sys

    from console.tui.control.service import ending_of

    stand_in = subprocess.Popen([sys.executable, "-c", "import time; from store.services import Announcement; "
                                 "a = Announcement('/models/m'); a.serving('http://127.0.0.1:9'); time.sleep(600)"])
    try:
        deadline = time.monotonic() + 30
        while (record := services.find(stand_in.pid)) is None or record.state != services.SERVING:
            assert time.monotonic() < deadline and stand_in.poll() is None
            await asyncio.sleep(0.05)
    finally:
        stand_in.kill()
        stand_in.wait()
    services.gone(record, "serve", "no exit status was recorded")  # the sweep's word first

    async def supervisor() -> None:
        await asyncio.sleep(0.3)
        services.end(record, services.how(-signal.SIGKILL), "serve", by="supervisor")

    _, ended = await asyncio.gather(supervisor(), ending_of(stand_in.pid))
    assert (ended.ending.by, ended.ending.cause()) == ("supervisor", "killed by SIGKILL during serve")
    alone = await ending_of(stand_in.pid, wait=0.2)  # a witness's words stand at once
    assert alone.ending.by == "supervisor"


async def test_the_age_of_an_ending_moves_in_the_header_registration_and_services():
    """One clock: the header's, the Registration pane's and the Services pane's `… ago` are
    rendered again each second (the header kept saying `0 s ago` while Services said `2 min ago`)."""
    ending = services.Ending(time.time(), "killed by SIGKILL", "serve", by="supervisor")
    record = dataclasses.replace(_this_process_as_a_service(), state=services.ENDED, ending=ending)
    ended = dataclasses.replace(snapshot(), services=ServicesSnapshot((ServiceView(record, "ok"),)))
    host = FakeHost("this", snapshots=[ended])
    app = Dsv4Console(SPEC, host=host, watch=False, create_default=False, interval=0)
    async with app.run_test(size=(180, 50)) as pilot:
        await pilot.pause()
        app.launch = app.service_control.new_launch(spawned=time.time() - 60)
        app.launch.end(ending.cause(), failed=True, ending=ending)
        app._tick()
        await pilot.pause()
        assert " s ago during serve" in str(app.query_one("#topbar").render())  # seconds, as the app started
        assert " s ago during serve" in str(app.query_one("#services-summary").render())
        # five minutes on (the records' clocks moved back, as the wall clock moves on)
        app.launch.ending = later = dataclasses.replace(ending, at=ending.at - 300)
        app.snapshot = dataclasses.replace(ended, services=ServicesSnapshot((
            ServiceView(dataclasses.replace(record, ending=later), "ok"),)))
        app._tick()
        await pilot.pause()
        header, summary = str(app.query_one("#topbar").render()), str(app.query_one("#registration-summary").render())
        listed = str(app.query_one("#services-summary").render())
    assert "killed by SIGKILL 5 min ago during serve" in header and "5 min ago" in summary
    assert "killed by SIGKILL 5 min ago during serve" in listed
