"""A launch of several ranks in the console: each rank's events, one row per phase for them all,
a line per rank with the slowest named, a rank's failure shown; single-process launches as before."""

from __future__ import annotations

import pytest
from console_fakes import SPEC, device_snapshot, fake_app
from textual.widgets import Static

from console.data.host import DeviceSnapshot, collect_device
from console.data.launch_state import DONE, FAILED, PENDING, RUNNING, LaunchState
from console.tui.panes.device import DevicePane, slots_text
from console.tui.panes.registration import rank_lines
from runtime.events import PHASES, Event, parse
from runtime.launch.budget import Memory
from runtime.model.dims import MAX_SLOTS
from store.units import format_size

REGISTER = PHASES[:-1]  # every rank runs these; only rank 0 serves


def _through(state: LaunchState, rank: int, phases: tuple[str, ...], world: int = 2) -> None:
    for phase in phases:
        detail = {"ranks": world, "rank": rank} if phase == "check" else {}
        state.apply(Event(phase, "start", detail=detail, rank=rank))
        state.apply(Event(phase, "end", seconds=0.1 * (rank + 1), rank=rank,
                          detail={"slots": 4, "budget_bytes": 1 << 30} if phase == "kv" else {}))


def _two_ranks_in_weights() -> LaunchState:
    """Rank 0 at weights 40 %, rank 1 at weights 12 %, both through check and programs."""
    state = LaunchState()
    for rank, done in ((0, 40), (1, 12)):
        _through(state, rank, ("check", "programs"))
        state.apply(Event("weights", "start", rank=rank))
        state.apply(Event("weights", "progress", done=done, total=100, unit="bytes", rank=rank,
                          detail={"group": f"layer {rank}"}))
    return state


def test_a_phase_row_is_done_only_when_every_rank_ended_it():
    state = LaunchState()
    _through(state, 0, ("check", "programs"), world=3)
    _through(state, 1, ("check", "programs"), world=3)
    # the check said 3 ranks: rank 2 has not spoken yet, so no row is done
    assert state.phases["check"].state == RUNNING and state.phases["programs"].state == RUNNING
    _through(state, 2, ("check",), world=3)
    assert state.phases["check"].state == DONE
    assert state.phases["check"].seconds == pytest.approx(0.3)  # the longest rank's
    assert state.phases["programs"].state == RUNNING and state.phases["weights"].state == PENDING


def test_the_row_shows_the_slowest_ranks_progress_and_what_it_does_now():
    state = _two_ranks_in_weights()
    weights = state.phases["weights"]
    assert weights.state == RUNNING
    assert (weights.done, weights.total) == (12, 100) and weights.fraction == pytest.approx(0.12)
    assert state.now["weights"] == "layer 1"  # the slowest rank's
    assert [(r.rank, r.phase, r.fraction) for r in state.rank_progress()] == [(0, "weights", 0.4), (1, "weights", 0.12)]
    assert state.slowest.rank == 1


def test_the_rank_at_an_earlier_phase_is_the_slowest_whatever_its_fraction():
    state = _two_ranks_in_weights()
    state.apply(Event("weights", "end", seconds=1.0, rank=1, detail={"path": "MAP"}))
    state.apply(Event("upload", "start", rank=1))
    assert state.slowest.rank == 0 and state.slowest.phase == "weights"
    assert state.phases["weights"].state == RUNNING and state.phases["upload"].state == RUNNING


def test_kv_path_is_rank_0s_and_serving_needs_only_rank_0():
    state = LaunchState()
    _through(state, 0, REGISTER)
    _through(state, 1, REGISTER)
    assert all(state.phases[p].state == DONE for p in REGISTER)
    assert state.phases["kv"].path == "4 slots"
    assert state.slowest is None  # every rank through registration
    state.apply(Event("serve", "start", rank=0))
    state.apply(Event("serve", "end", seconds=0.2, rank=0, detail={"url": "http://127.0.0.1:9"}))
    assert state.phases["serve"].state == DONE and state.url == "http://127.0.0.1:9"


def test_a_ranks_error_fails_the_row_and_names_the_rank():
    state = _two_ranks_in_weights()
    state.apply(Event("weights", "error", seconds=2.0, message="weights: checksum mismatch", rank=1))
    assert state.phases["weights"].state == FAILED
    assert state.phases["weights"].path == "rank 1: weights: checksum mismatch"
    assert state.error == "rank 1: weights: checksum mismatch"
    assert state.slowest is None
    failed = [r for r in state.rank_progress() if r.state == FAILED]
    assert [(r.rank, r.phase, r.message) for r in failed] == [(1, "weights", "weights: checksum mismatch")]


def test_a_rank_killed_without_a_word_fails_the_phase_the_launcher_names():
    state = _two_ranks_in_weights()
    state.apply(parse('{"v":1,"ts":1,"phase":"serve","kind":"error",'
                      '"message":"rank 1 died (SIGKILL) during phase weights",'
                      '"detail":{"rank":1,"phase":"weights"}}'))
    assert state.phases["weights"].state == FAILED
    assert state.phases["serve"].state == PENDING  # the launch never got to serve
    assert state.error == "rank 1 died (SIGKILL) during phase weights"
    assert state.ranks[1].phases["weights"].state == FAILED and state.ranks[0].phases["weights"].state == RUNNING


def test_rank_events_arrive_as_json_lines_too():
    state = LaunchState()
    state.apply(parse('{"v":1,"ts":1,"phase":"check","kind":"start","rank":1,"detail":{"ranks":2,"rank":1}}'))
    assert state.world == 2 and [r.rank for r in state.rank_progress()] == [0, 1]
    assert state.rank_progress()[0].phase == "-" and state.slowest.rank == 0  # rank 0 not heard from


def test_a_single_process_launch_has_no_rank_lines():
    state = LaunchState()
    for phase in PHASES:
        state.apply(Event(phase, "start"))
        state.apply(Event(phase, "end", seconds=0.5))
    assert state.ranks == {} and state.rank_progress() == [] and state.slowest is None
    assert rank_lines(state) == []


async def _registration_text(launch: LaunchState) -> tuple[str, str | None]:
    """The Registration pane's summary, and its per-rank lines (None when hidden)."""
    app = fake_app()
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        app.launch = launch
        app.show_registration()
        await pilot.pause()
        ranks = app.query_one("#registration-ranks", Static)
        return (str(app.query_one("#registration-summary", Static).render()),
                str(ranks.render()) if ranks.display else None)


@pytest.mark.asyncio
async def test_the_pane_shows_a_line_per_rank_and_names_the_slowest():
    _, text = await _registration_text(_two_ranks_in_weights())
    lines = text.splitlines()
    assert lines[0] == "slowest: rank 1 (weights 12%)"
    assert lines[1:] == ["rank 0 … weights ██░░  40%   rank 1 … weights ░░░░  12%"]  # the table keeps its rows


@pytest.mark.asyncio
async def test_the_pane_shows_a_ranks_error():
    launch = _two_ranks_in_weights()
    launch.apply(Event("weights", "error", message="weights: checksum mismatch", rank=1))
    summary, text = await _registration_text(launch)
    assert "rank 1: weights: checksum mismatch" in summary
    assert "slowest" not in text
    assert "rank 1 ✗ weights" in text


@pytest.mark.asyncio
async def test_the_pane_of_a_single_process_launch_has_no_rank_lines():
    launch = LaunchState()
    launch.apply(Event("weights", "start"))
    launch.apply(Event("weights", "progress", done=40, total=100))
    summary, text = await _registration_text(launch)
    assert text is None and "rank" not in summary


async def _device_text(snap: DeviceSnapshot) -> list[str]:
    app = fake_app()
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        app.query_one(DevicePane).show(snap)
        await pilot.pause()
        return str(app.query_one("#device-text", Static).render()).splitlines()


@pytest.mark.asyncio
async def test_on_cpu_ranks_share_the_kv_budget():
    spec = SPEC.with_(memory_utilization=0.95, max_slots=MAX_SLOTS)
    one = collect_device(spec, "cpu", slot_bytes=1 << 20)
    two = collect_device(spec.with_(ranks=2), "cpu", slot_bytes=1 << 20)
    (b1,), (b2, b2_other) = one.budgets, two.budgets
    assert abs(b2.budget - b1.budget // 2) < 64 << 20  # host memory moves between the two reads
    assert b2.share == 2 and b2.fits == b2.budget // (1 << 20) and b2_other.rank == 1
    first = (await _device_text(two))[0]
    assert " × 2 ranks · " in first and slots_text(b2, "each ") in first
    assert two.slots == b2.slots + b2_other.slots and first.endswith(f" · {two.slots} in all")
    assert "each fits" in first if b2.fits > b2.slots else f"each {b2.slots} slots" in first
    single = await _device_text(one)
    assert single[0].startswith("KV budget") and " slots" in single[0] and "rank" not in single[0]
    assert single[1].endswith("one KV slot 1.0 MiB")


@pytest.mark.asyncio
async def test_the_device_pane_says_what_fits_and_what_the_launch_takes():
    snap = device_snapshot()  # 16 GiB, 8 GiB used: the budget holds thousands of slots, --max-slots caps
    line = (await _device_text(snap))[0]
    assert line == (f"KV budget {format_size(snap.budgets[0].budget)} · fits {snap.fits} slots "
                    f"· launch takes {SPEC.max_slots} (--max-slots)")
    assert snap.slots == SPEC.max_slots < snap.fits


@pytest.mark.asyncio
async def test_on_accelerators_each_rank_has_a_device_and_too_many_ranks_warn():
    gib = 1 << 30
    gpus = [Memory(80 * gib, 79 * gib, gib, f"cuda:{i} H100") for i in range(2)]
    snap = device_snapshot(spec=SPEC.with_(ranks=4, memory_utilization=0.9, max_slots=100), kind="cuda",
                           devices=gpus, slot_bytes=gib)
    text = await _device_text(snap)
    assert text[0] == "⚠ 4 ranks need one cuda device each, 2 found"
    assert text[1] == "rank 0 on cuda:0  KV budget 71.0 GiB · 71 slots"
    assert text[2].startswith("rank 1 on cuda:1  KV budget")
    assert text[3] == f"2 ranks · {snap.slots} slots in all (each rank holds its own sequences)" and \
        snap.slots == 2 * 71


def test_a_device_without_a_rank_sizes_no_kv_and_only_cpu_splits_the_budget():
    cpu = collect_device(SPEC.with_(ranks=3, memory_utilization=0.95), "cpu", slot_bytes=1 << 20)
    assert cpu.warning == "" and [b.share for b in cpu.budgets] == [3, 3, 3]
    gib = 1 << 30
    gpus = [Memory(80 * gib, 79 * gib, gib, f"cuda:{i} H100") for i in range(4)]
    two = device_snapshot(spec=SPEC.with_(ranks=2), kind="cuda", devices=gpus, slot_bytes=gib)
    assert [b.device for b in two.budgets] == ["cuda:0 H100", "cuda:1 H100"]  # cuda:2 and :3 have no rank
    starving = collect_device(SPEC.with_(ranks=2, memory_utilization=0.01), "cpu", slot_bytes=1 << 20)
    assert "residual usage leaves no KV budget" in starving.budgets[0].problem and starving.slots == 0
