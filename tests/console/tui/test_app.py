"""dsv4-console without workers: read-only guard, no torch, --once --json, collectors, panes."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO
from console_fakes import SPEC, FakeCollectors, fake_app, record, snapshot
from textual.widgets import DataTable

from console.data.collectors import collect_device, default_model_dir, predict
from console.data.launch_state import DONE, LaunchState
from console.data.records import LaunchRecord
from console.data.snapshot import SCHEMA_VERSION
from console.tui.app import MUTATING, Dsv4Console
from console.tui.screens.confirm import ConfirmScreen
from runtime.events import PHASES, Event
from runtime.launch.plan_report import KvPlan, Problem


@pytest.mark.asyncio
async def test_readonly_refuses_every_mutating_action_through_one_guard():
    app = fake_app(readonly=True)
    bound = {b.id: b for b in app.BINDINGS if b.action.startswith("mutate(")}
    assert set(bound) == MUTATING - {"create"}  # every mutating key goes through the guard
    async with app.run_test() as pilot:
        await pilot.pause()
        for binding in bound.values():
            await pilot.press(binding.key)
        await app.run_action("mutate('create')")
        await pilot.pause()
        assert sorted(app.refused) == sorted(MUTATING)
        assert app.jobs == {} and app.service is None
        assert not isinstance(app.screen, ConfirmScreen)  # purge did not even ask


@pytest.mark.asyncio
async def test_panes_render_the_snapshot_and_filter_narrows_rows():
    app = fake_app()
    async with app.run_test(size=(180, 50)) as pilot:
        await pilot.pause()
        table = app.query_one("#programs-table", DataTable)
        assert table.row_count == 4
        await pilot.press("slash")
        await pilot.press(*"stale")
        await pilot.pause()
        assert table.row_count == 1
        await pilot.press("enter")  # enter keeps the filter; esc clears it
        assert app.needle == "stale"
        await pilot.press("slash", "escape")
        await pilot.pause()
        assert app.needle == "" and table.row_count == 4


def test_collect_device_warns_when_residual_usage_starves_the_kv_cache():
    # 1 % of host memory is below what is in use
    snap = collect_device(SPEC.with_(memory_utilization=0.01), "cpu", slot_bytes=1 << 20)
    assert snap.budgets[0].budget <= 0
    assert "residual usage leaves no KV budget" in snap.budgets[0].problem and snap.slots == 0
    ok = collect_device(SPEC.with_(memory_utilization=0.95), "cpu", slot_bytes=1)
    assert ok.budgets[0].problem == "" and ok.slots == SPEC.max_slots < ok.fits


def test_prediction_renders_the_plan_and_names_the_launches_it_compares_with():
    """Only launches like the plan's are named: the same settings for best warm, the same paths
    too for the one compared; an eager launch or another --max-seq never."""
    s = snapshot()
    spec = SPEC.with_(backend="auto")
    like, warm = record(2.5, pid=4101, program="MISS"), record(0.4, pid=4002)
    history = [like, warm, record(0.01, pid=4003, backend="export"), record(0.3, pid=4004, max_seq=512, program="MISS")]
    pred = predict(spec, history, s.plan, s.device)
    assert pred.prediction["programs"] == "HIT 1 MISS 1 STALE 1 CORRUPT 1"
    assert pred.prediction["weights"] == "MAP"
    assert pred.prediction["kv"] == "32 slots of 1.0 MiB"
    assert pred.predicted == s.plan.predicted
    assert pred.best_warm == LaunchRecord.of(warm) and pred.previous == LaunchRecord.of(like) and pred.earlier is None
    assert pred.basis.startswith("from the last launch with these settings and paths")
    assert predict(spec, history, dataclasses.replace(s.plan, like=None), s.device).previous is None  # a failed plan
    starving = dataclasses.replace(s.plan, kv=KvPlan(problem="not even one KV slot fits"),
                                   problems=(Problem(kind="check", text="config.json: bad"),))
    pred = predict(spec, [], starving, s.device)
    assert pred.prediction["kv"].startswith("FAIL") and pred.prediction["check"] == "FAIL: config.json: bad"


def test_launch_state_follows_events_to_serving():
    state = LaunchState()
    for phase in PHASES:
        state.apply(Event(phase, "start"))
        detail = {"url": "http://127.0.0.1:9"} if phase == "serve" else \
            {"counts": {"HIT": 3}} if phase == "programs" else {}
        state.apply(Event(phase, "end", seconds=0.5, detail=detail))
    assert all(p.state == DONE for p in state.phases.values())
    assert state.url == "http://127.0.0.1:9" and state.phases["programs"].path == "HIT 3"


def test_default_model_dir_is_the_runtime_one():
    from runtime.synth.checkpoint import default_model_dir as runtime_default

    assert default_model_dir() == runtime_default()


def test_once_json_prints_every_pane(tmp_path, tiny_ckpt_ro):
    out = subprocess.run([sys.executable, "-m", "console.tui.app", "--once", "--json", "--model", str(tiny_ckpt_ro),
                          "--kernel-cache-dir", str(tmp_path / "programs"), "--device", "cpu"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    data = json.loads(out.stdout)
    assert data["v"] == SCHEMA_VERSION and data["host_name"] == "local" and data["hostname"] == socket.gethostname()
    assert set(data) >= {"settings", "plan", "programs", "cache", "sidecars", "services", "host", "device",
                         "registration", "toolchain", "nodes"}
    assert data["toolchain"]["torch"] and data["toolchain"]["dsv4"]
    assert data["sidecars"]["wanted"]["verdict"] == "REPACK" and data["sidecars"]["wanted"]["reason"] == "missing"
    assert data["plan"]["sidecar"]["reason"] == "missing"
    assert {p["state"] for p in data["plan"]["programs"]} == {"MISS"}  # an empty cache
    assert data["programs"]["entries"] == data["plan"]["programs"]  # the pane renders the plan
    assert {"cpu_percent", "per_core", "load", "mem_available", "page_cache", "disk_read_bps"} <= set(data["host"])
    device, budget = data["device"]["devices"][0], data["device"]["budgets"][0]
    assert {"total", "used", "free"} <= set(device) and {"budget", "fits", "slots", "problem"} <= set(budget)
    assert data["device"]["slots"] == data["plan"]["kv"]["slots"]  # one budget: the pane says what the plan does
    assert set(data["registration"]["prediction"]) == set(PHASES)


@pytest.mark.slow
def test_console_never_imports_torch(tmp_path, tiny_ckpt_ro):
    """Import the app, run it headless with the real collectors, walk every screen: no torch."""
    script = textwrap.dedent(f"""
        import asyncio, sys
        from pathlib import Path
        from console.tui.app import Dsv4Console
        from console.data.collectors import console_spec

        async def main():
            app = Dsv4Console(console_spec({str(tiny_ckpt_ro)!r}, {str(tmp_path / "programs")!r}), interval=0.2)
            async with app.run_test() as pilot:
                for _ in range(300):  # the first snapshot is collected after the first paint
                    if app.snapshot is not None:
                        break
                    await pilot.pause(0.1)
                assert app.snapshot is not None
                await pilot.press("question_mark")
                await pilot.press("escape")
                await pilot.press("c")  # the kernel cache's contents
                await pilot.pause(0.2)
                await pilot.press("r")
                await pilot.pause(0.3)
        asyncio.run(main())
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.asyncio
async def test_launching_a_model_that_is_already_served_asks_first(tiny_ckpt_ro):
    snap = snapshot()
    view = snap.services.services[0]
    view = dataclasses.replace(view, record=dataclasses.replace(view.record, model=str(tiny_ckpt_ro), events=""))
    snap = dataclasses.replace(snap, services=dataclasses.replace(snap.services, services=(view,)))
    app = Dsv4Console(SPEC.with_(model=tiny_ckpt_ro), host=FakeCollectors(snap), watch=False,
                      create_default=False, interval=0)
    async with app.run_test() as pilot:
        await pilot.pause()
        await pilot.press("l")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmScreen)
        assert "pid 4242 http://127.0.0.1:8000" in app.screen.body
        await pilot.press("n")
        await pilot.pause()
        assert app.service is None and "launch" not in app.jobs


def test_a_running_launch_says_which_program_it_prepares_now_and_how_long_is_left():
    from console.tui.panes.registration import phase_progress

    order = [f"program.{i}" for i in range(20)]
    state = LaunchState(order=order, predicted={"programs": 40.0})
    state.apply(Event("programs", "start", ts=time.time() - 10))
    state.apply(Event("programs", "progress", done=1, total=20, detail={"program": order[0], "outcome": "MISS"}))
    assert state.now["programs"] == "preparing program.1"
    line = phase_progress("programs", state.phases["programs"], 40.0, state.now["programs"])
    # 1 of 20 done in 10 s: the rate measured here (19 left at 0.1/s), not the plan's 0.5/s, and it says so
    assert line.startswith("programs · 1/20 · 10s elapsed · ETA 3m") and "(measured at 0.10/s)" in line
    assert line.endswith("now: preparing program.1")


def test_compile_pool_log_events_give_done_total_and_what_compiles_now():
    state = LaunchState()
    state.apply(Event("programs", "start", detail={"total": 3}))
    for name, st in (("a", "queued"), ("b", "queued"), ("c", "queued"), ("a", "compiling"), ("b", "compiling")):
        state.apply(Event("programs", "log", message=f"{name}: {st}",
                          detail={"program": name, "state": st, "expected_s": 10.0}))
    assert state.now["programs"] == "compiling a +1"
    state.apply(Event("programs", "log", detail={"program": "a", "state": "published"}))
    p = state.phases["programs"]
    assert (p.done, p.total, state.now["programs"]) == (1, 3, "compiling b")
    assert state.pool.expected == {"a": 10.0, "b": 10.0, "c": 10.0} and state.pool.finished == {"a"}


def test_registration_shows_programs_by_tier_until_every_swap():
    from console.data.launch_state import LaunchState
    from runtime.events import Event

    launch = LaunchState()
    for name in ("a", "b"):
        launch.apply(Event("programs", "progress", done=1, total=2,
                           detail={"program": name, "outcome": "MISS", "tier": "eager"}))
    assert launch.tier_line == "programs: eager 2 · compiled 0"
    launch.apply(Event("programs", "log", message="a: compiled tier swapped in",
                       detail={"program": "a", "tier": "compiled"}))
    assert launch.tier_line == "programs: eager 1 · compiled 1"
    launch.apply(Event("programs", "log", message="b: compiled tier swapped in",
                       detail={"program": "b", "tier": "compiled"}))
    assert launch.tier_line == ""


@pytest.mark.asyncio
async def test_a_finished_launch_shows_its_own_prediction_beside_its_actuals():
    """The prediction made for a launch (its check event carries its plan's) stays with it,
    whatever the console plans next: a delta per phase and a predicted-vs-actual total."""
    from textual.widgets import Static

    from runtime.events import REGISTRATION

    state = LaunchState(predicted={"check": 99.0})  # what the console predicted: superseded by the launch's own
    plan = {"predicted": {"check": 0.1, "programs": 2.0, "weights": 1.0, "upload": None, "kv": 0.1, "validate": 0.8},
            "basis": {"check": "history", "programs": "history", "weights": "model", "upload": None, "kv": "history",
                      "validate": "history"}, "compared": {"started": 1.0, "pid": 7}}
    actual = {"check": 0.1, "programs": 2.5, "weights": 1.0, "upload": 0.01, "kv": 0.1, "validate": 0.8}
    for phase in REGISTRATION:
        state.apply(Event(phase, "start"))
        state.apply(Event(phase, "end", seconds=actual[phase], detail={"plan": plan} if phase == "check" else {}))
    # upload's seconds unknown: the registration span is not predicted, as its history record says (None)
    assert state.predicted == plan["predicted"] and state.registration() == (None, pytest.approx(3.51))
    app = fake_app()
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        app.launch = state
        app.show_registration()
        await pilot.pause()
        summary = str(app.query_one("#registration-summary", Static).render())
        table = app.query_one("#registration-table", DataTable)
        cells = {str(table.get_row_at(i)[0]).split()[-1]: [str(c) for c in table.get_row_at(i)] for i in range(6)}
    assert "registration 3.51 s (not predicted: a phase's seconds were unknown)" in summary
    assert "weights from recorded compile seconds and throughput" in summary and "upload unknown" in summary
    assert "+25%" in cells["programs"] and "+0.00 s" in cells["check"]  # 0.1 s apart or less: seconds, not a share


def test_a_compile_eta_spreads_what_is_left_over_the_pools_workers_at_the_rate_seen_here():
    from console.data.launch_state import ProgramStates

    pool, t0 = ProgramStates(), 1000.0
    for name in "abcd":
        pool.feed({"program": name, "state": "queued", "expected_s": 10.0, "workers": 2}, t0)
    assert pool.eta(t0) == 20.0  # four of 10 s on two workers: 20 s, not their 40 s sum
    pool.feed({"program": "a", "state": "compiling"}, t0)
    pool.feed({"program": "b", "state": "compiling"}, t0)
    pool.feed({"program": "a", "state": "published", "seconds": 5.0}, t0 + 5)  # twice as fast as expected here
    pool.feed({"program": "c", "state": "compiling"}, t0 + 5)
    # b has run 5 s of its 5 (scaled) s, c 0 of 5, d waits 5: both workers free at +5 s
    assert pool.eta(t0 + 5) == 10.0 - 5.0
    assert ProgramStates().eta() == 0.0 and pool.scale() == 0.5
