"""The fleet screen over fake hosts, pressed as an operator would: one guard (read-only refuses
here too), one filter, a host left out with a key, a launch over the rest, and a host opened from
the fleet keeping its actions (they run on that host)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from console_fakes import snapshot

from console.fleet.fake import Answer, FakeHost, Ledger
from console.fleet.session import FleetSession
from console.fleet.spec import Fleet, FleetHost
from console.tui.app import Dsv4Console
from console.tui.screens.confirm import ConfirmScreen
from runtime.launch.spec import LaunchSpec

SPEC = LaunchSpec(Path("/models/v4"), backend="export", device="cpu", max_seq=64)
pytestmark = pytest.mark.asyncio


def _app(**kw) -> tuple[Dsv4Console, dict[str, FakeHost]]:
    ledger = Ledger()
    script = {"host-a": {("node", "start"): Answer.record(pid=4321, master="10.0.0.1:29577")}}
    hosts = [FakeHost(n, i, snapshots=[snapshot()], ledger=ledger, script=script.get(n))
             for i, n in enumerate(("host-a", "host-b", "host-c"))]
    fleet = Fleet(tuple(FleetHost(h.name, h.node_rank) for h in hosts))
    session = FleetSession(hosts, SPEC.with_(ranks=3), fleet=fleet)
    app = Dsv4Console(SPEC, session=session, interval=0, watch=False, create_default=False, **kw)
    return app, {h.name: h for h in hosts}


async def _until(pilot, done, what: str) -> None:
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await pilot.pause(0.05)


async def _rows(pilot, app):
    screen = app.screen
    await _until(pilot, lambda: screen.snapshot is not None and len(screen.rows()) == 3, "three hosts")
    return screen


async def test_read_only_refuses_the_fleets_actions_through_the_one_guard():
    app, hosts = _app(readonly=True)
    async with app.run_test(size=(200, 50)) as pilot:
        await _rows(pilot, app)
        await pilot.press("w", "l", "x", "minus")
        await pilot.pause()
        assert app.refused == ["warm", "launch", "purge", "leave_out"]
        assert not isinstance(app.screen, ConfirmScreen) and all(h.commands == [] for h in hosts.values())


async def test_a_host_left_out_with_a_key_and_a_launch_over_the_rest():
    app, hosts = _app()
    async with app.run_test(size=(200, 50)) as pilot:
        screen = await _rows(pilot, app)
        screen.query_one("#fleet-table").move_cursor(row=2)
        await pilot.press("minus")  # host-c out
        await pilot.pause()
        assert app.session.left_out == {"host-c"} and app.spec.ranks == 2
        assert "ranks 2 over 2 hosts" in str(screen.query_one("#fleet-top").render())
        await pilot.press("slash", *"host-b")
        await pilot.pause()
        assert [r["host"] for r in screen.query_one("#fleet-table").rows_shown] == ["host-b"]  # the one filter
        await pilot.press("escape")
        await pilot.press("l")
        await _until(pilot, lambda: isinstance(app.screen, ConfirmScreen), "the launch question")
        assert "On 2 hosts: host-a, host-b" in app.screen.body and "left out: host-c" in app.screen.body
        await pilot.press("y")
        await _until(pilot, lambda: all(h in app.fleet.jobs and app.fleet.jobs[h].ok for h in ("host-a", "host-b")),
                     "the launch")
        assert hosts["host-c"].commands == []
        said = [line for _, line in app.fleet.log]
        assert "host-c left out: ranks, plans and launches cover the others" in said
        assert any(line.startswith("launch done on host-a, host-b in ") for line in said)


async def test_a_host_opened_from_the_fleet_keeps_its_actions_and_they_run_there():
    app, hosts = _app()
    async with app.run_test(size=(200, 50)) as pilot:
        screen = await _rows(pilot, app)
        screen.query_one("#fleet-table").move_cursor(row=1)
        await pilot.press("enter")
        await _until(pilot, lambda: app.host is not None and app.snapshot is not None, "host-b's panes")
        assert app.host.name == "host-b" and app.remote == "host-b"
        await pilot.press("w")
        await _until(pilot, lambda: "warm" in app.jobs and app.jobs["warm"].returncode is not None
                     and app.jobs["warm"].args[0] == "compile", "host-b's warm")
        assert [a[:2] for a in hosts["host-b"].commands] == [("sidecar", "warm"), ("compile", "/models/v4")]
        assert hosts["host-a"].commands == [] and app.failures == []
        await pilot.press("F")
        assert app.screen is screen


async def test_a_failed_nodes_detail_says_its_cause_not_torchruns_footer():
    """The node line says how it ended and the failing rank's own words (issue 71: it showed the
    log's last lines, torchrun's `traceback : To enable traceback see: …` footer)."""
    import dataclasses

    from console.data.nodes import NodeView
    from store.nodes import Node, NodeEnding

    ending = NodeEnding(at=time.time(), how="exited 1", reason="rank 1 on host-b (pid 712) was killed by SIGKILL",
                        lines=("N/A> / traceback : To enable traceback see: https://pytorch.org/docs/elastic",))
    node = Node(pid=700, create_time=1.0, node_rank=0, nnodes=2, master="10.0.0.1:29577", model="/models/v4",
                log="/state/nodes/n.log", events="", ending=ending)
    app, hosts = _app()
    hosts["host-a"].snapshots[0] = dataclasses.replace(snapshot(), nodes=(NodeView(node=node, state=node.state()),))
    async with app.run_test(size=(200, 50)) as pilot:
        screen = await _rows(pilot, app)
        screen.query_one("#fleet-table").move_cursor(row=0)
        await pilot.pause()
        screen.detail()
        said = str(screen.query_one("#fleet-detail").render())
    assert "exited 1 — rank 1 on host-b (pid 712) was killed by SIGKILL" in said and "traceback" not in said
