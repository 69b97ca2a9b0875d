"""One launch, one set of numbers (issue 71 item 5): the Registration pane's figures are its
history record's — the whole launch's seconds, each phase's the slowest rank's, the registration
span beside the plan's prediction of the same span (`runtime.launch.history.span`) — and a
launch that registered and died later still predicts the next one."""

from __future__ import annotations

import dataclasses

import pytest
from console_fakes import SPEC, fake_app, record, snapshot
from textual.widgets import Static

from console.data.collectors import predict
from console.data.launch_state import LaunchState
from console.data.records import LaunchRecord
from console.tui.screens.history import cells, row
from runtime.events import REGISTRATION, Event
from runtime.launch.history import launch_seconds, slowest, span

# rank 0's and rank 1's seconds per phase: rank 1 compiles longer, rank 0 reads its weights longer
BY_RANK = {0: {"check": 0.3, "programs": 19.12, "weights": 3.0, "upload": 0.1, "kv": 0.2, "validate": 1.0},
           1: {"check": 0.4, "programs": 40.24, "weights": 2.5, "upload": 0.1, "kv": 0.3, "validate": 0.9}}
PREDICTED = {"check": 0.3, "programs": 19.12, "weights": 2.9, "upload": 0.1, "kv": 0.2, "validate": 1.0}
WHOLE, REGISTERED = 64.92, 42.31  # what the serve event says: process start to serving, check through validate


def _launch(serve_detail: dict) -> LaunchState:
    """A 2-rank launch through serving, from its events as `dsv4 serve` emits them."""
    state = LaunchState()
    plan = {"predicted": PREDICTED, "basis": {p: "history" for p in PREDICTED}}
    for rank, seconds in BY_RANK.items():
        for phase in REGISTRATION:
            start = {"ranks": 2, "rank": rank} if phase == "check" else {}
            state.apply(Event(phase, "start", detail=start, rank=rank))
            state.apply(Event(phase, "end", seconds=seconds[phase], rank=rank,
                              detail={"plan": plan} if phase == "check" and rank == 0 else {}))
    state.apply(Event("serve", "start", rank=0))
    state.apply(Event("serve", "end", seconds=0.05, rank=0, detail={"url": "http://127.0.0.1:9", **serve_detail}))
    return state


def _history_line() -> dict:
    """The same launch's history line, as runtime.launch.launched.Launched.record writes it."""
    phases = {p: {"seconds": s} for p, s in BY_RANK[0].items()} | {"serve": {"seconds": 0.05, "url": "http://x"}}
    return {**record(0.0), "phases": slowest(phases, BY_RANK), "seconds": WHOLE, "registration_seconds": REGISTERED,
            "predicted_registration_seconds": span(PREDICTED)}


def test_the_pane_says_what_the_launchs_history_record_says():
    state, line = _launch({"launch_seconds": WHOLE, "registration_seconds": REGISTERED}), _history_line()
    rec = LaunchRecord.of(line)
    assert state.total_seconds == rec.seconds == launch_seconds(line) == WHOLE  # the whole launch, not its phases' sum
    assert state.registration() == (rec.predicted_registration_seconds, rec.registration_seconds)
    assert state.registration() == (span(PREDICTED), REGISTERED)
    for phase in REGISTRATION:  # each phase the slowest rank's, on both sides
        assert state.phases[phase].seconds == rec.phase(phase).seconds == max(s[phase] for s in BY_RANK.values())
    shown = cells(row(rec))
    assert shown["total"] == "64.92 s" and shown["registration"] == f"42.31 s · {span(PREDICTED):.2f} s"
    assert LaunchRecord.from_json(rec.to_json()) == rec  # a snapshot carries it across hosts unchanged


def test_without_the_serve_events_figures_the_span_is_the_records_formula_over_the_slowest_ranks():
    """An older service's serve event: the registration is `history.span` of the phases (programs
    ∥ weights: the longer counts), never their sum — the colleague's `predicted 15.41 s ·
    actual 5.41 s` added programs and weights on one side."""
    state = _launch({})
    slowest_each = {p: max(s[p] for s in BY_RANK.values()) for p in REGISTRATION}
    predicted, actual = state.registration()
    assert actual == span(slowest_each) == round(0.4 + 40.24 + 0.1 + 0.3 + 1.0, 4)
    assert predicted == span(PREDICTED) == round(0.3 + 19.12 + 0.1 + 0.2 + 1.0, 4)
    assert actual != round(sum(slowest_each.values()), 4) and predicted != round(sum(PREDICTED.values()), 4)
    assert state.total_seconds == pytest.approx(sum(slowest_each.values()) + 0.05)  # never served: the phases' sum


def test_a_phase_without_a_prediction_leaves_the_registration_unpredicted():
    state = _launch({"registration_seconds": REGISTERED})
    state.predicted = {**PREDICTED, "programs": None}
    assert state.registration() == (None, REGISTERED)


@pytest.mark.asyncio
async def test_the_pane_names_the_span_and_shows_the_records_figures():
    app = fake_app()
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        app.launch = _launch({"launch_seconds": WHOLE, "registration_seconds": REGISTERED})
        app.show_registration()
        await pilot.pause()
        summary = str(app.query_one("#registration-summary", Static).render())
    assert f"registration predicted {span(PREDICTED):.2f} s · actual 42.31 s" in summary
    assert "this launch 64.92 s" in summary


def test_a_launch_that_registered_and_was_killed_later_still_predicts_the_next():
    s = snapshot()
    killed = {**record(2.5, outcome="killed", pid=4101, program="MISS"), "error": "killed by SIGKILL"}
    never = {**record(0.5, outcome="error", pid=4102, program="MISS"), "error": "kv: not even one slot"}
    del never["phases"]["serve"]  # it never served
    pred = predict(SPEC.with_(backend="auto"), [killed, never], s.plan, s.device)
    assert pred.previous == LaunchRecord.of(killed)
    assert predict(SPEC.with_(backend="auto"), [never], dataclasses.replace(s.plan), s.device).previous is None
