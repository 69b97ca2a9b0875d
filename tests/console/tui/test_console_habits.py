"""Console habits an operator expects: sizes, the log, sorting, details, the palette, the
history view, progress lines, plain tables, `--version`, completion (fake collectors)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import REPO
from console_fakes import NOW, FakeCollectors, fake_app
from textual.widgets import RichLog, Static

from console import fmt
from console.cli.output import print_table
from console.data.eta import Progress
from console.data.records import LaunchRecord
from console.tui.app import MUTATING
from console.tui.screens.detail import DetailScreen, as_text, describe
from console.tui.screens.history import HistoryScreen
from console.tui.tables import PaneTable
from console.tui.workers import LineFilter


@pytest.mark.asyncio
async def test_a_40x12_terminal_gets_one_line_instead_of_a_broken_layout():
    app = fake_app()
    async with app.run_test(size=(40, 12)) as pilot:
        await pilot.pause()
        assert app.query_one("#too-small", Static).display
        assert app.query_one("#too-small", Static).region.height > 0
        assert app.query_one("#panes").region.height == 0
        assert "terminal too small (need 80×24)" in str(app.query_one("#too-small", Static).render())


@pytest.mark.asyncio
async def test_the_log_wraps_to_its_width_and_follows_the_tail_only_at_the_bottom():
    app = fake_app()
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        log = app.query_one(RichLog)
        app.log_line("warm", "x" * 150)  # wider than RichLog's default 78, narrower than the pane
        await pilot.pause()
        assert len(log.lines) == 1
        for i in range(100):
            app.log_line("warm", f"line {i}")
        await pilot.pause()
        assert log.is_vertical_scroll_end
        log.scroll_home(animate=False)
        await pilot.pause()
        app.log_line("warm", "while the operator reads above")
        await pilot.pause()
        assert log.scroll_y == 0  # not yanked to the bottom
        log.scroll_end(animate=False)
        await pilot.pause()
        app.log_line("warm", "at the bottom again")
        await pilot.pause()
        assert log.is_vertical_scroll_end


@pytest.mark.asyncio
async def test_ctrl_s_saves_the_whole_log_to_a_file_under_the_state_dir():
    from store.paths import state_dir

    app = fake_app()
    async with app.run_test() as pilot:
        await pilot.pause()
        app.log_line("prepack", "layer 3/5 packed")
        app.log_line("error", "something failed")
        await pilot.press("ctrl+s")
        await pilot.pause()
    saved = list((state_dir() / "logs").glob("console-*.log"))
    assert len(saved) == 1
    text = saved[0].read_text()
    assert "prepack layer 3/5 packed" in text and "error something failed" in text


def test_worker_library_warnings_become_one_line_each_and_repeat_never():
    f = LineFilter()
    torch_warning = ["/venv/lib/torch/_inductor/lowering.py:1234: FutureWarning: `foo` is deprecated",
                     "  warnings.warn("]
    shown = [out for line in [*torch_warning, *torch_warning, "compiled head.decode"] for out in f(line)]
    assert shown == ["FutureWarning: `foo` is deprecated (lowering.py:1234)", "compiled head.decode"]


@pytest.mark.asyncio
async def test_sorting_enter_for_details_and_the_filter_count_in_each_title():
    app = fake_app()
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        table = app.query_one("#programs-table", PaneTable)
        # problems first by default: what a launch replaces, then compiles, then loads; the column marked
        assert [r["state"] for r in table.rows_shown] == ["CORRUPT", "STALE", "MISS", "HIT"]
        assert "next launch ▲" in [str(c.label) for c in table.columns.values()]
        await pilot.press("O")
        assert [r["state"] for r in table.rows_shown] == ["HIT", "MISS", "STALE", "CORRUPT"]
        await pilot.press("o")  # next column: the fingerprint, still reversed
        assert [r["fingerprint"] for r in table.rows_shown] == sorted((r["fingerprint"] for r in table.rows_shown),
                                                                      reverse=True)
        assert "fp ▼" in [str(c.label) for c in table.columns.values()]
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, DetailScreen)
        assert re.search(rf"\[b\]fingerprint:\[/\] +{table.rows_shown[0]['fingerprint']}$", app.screen.text,
                         re.M)  # in full
        await pilot.press("escape")
        await pilot.press("slash", *"stale", "enter")
        await pilot.pause()
        titles = {p: str(app.query_one(f"#{p}").border_title) for p in ("programs", "sidecars", "services")}
        assert titles["programs"].startswith("Programs 1 of 4")
        assert titles["sidecars"].startswith("Sidecars 0 of 2")
        assert titles["services"].startswith("Services 0 of 1")


@pytest.mark.parametrize("readonly", [False, True])
def test_the_palette_lists_every_action_and_readonly_hides_the_mutating_ones(readonly):
    app = fake_app(readonly=readonly)
    titles = " ".join(c.title for c in app.get_system_commands(None))
    for name in ("Quit", "Help", "Refresh", "Filter", "Zoom", "History", "Save log", "Sort"):
        assert name in titles
    mutating = ("Prepack", "Warm", "Purge", "Launch", "Stop")
    assert all((m in titles) != readonly for m in mutating)
    assert {b.id for b in app.BINDINGS if b.action.startswith("mutate(")} <= MUTATING


@pytest.mark.asyncio
async def test_h_shows_past_launches_newest_first_and_filters_them():
    records = [{"model": "/m/a", "pid": 1, "started": NOW - 300, "outcome": "ok", "phases": {}},
               {"model": "/m/b", "pid": 2, "started": NOW - 200, "outcome": "error", "error": "kv: too small",
                "phases": {"weights": {"seconds": 1.0, "path": "REPACK", "reason": "missing"}}},
               {"model": "/m/a", "pid": 3, "started": NOW - 100, "outcome": "ok", "phases": {}}]
    collectors = FakeCollectors()
    collectors.history = lambda: [LaunchRecord.of(r) for r in records]
    app = fake_app(collectors=collectors)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        await pilot.press("h")
        await pilot.pause()
        assert isinstance(app.screen, HistoryScreen)
        table = app.screen.query_one(PaneTable)
        assert [r["pid"] for r in table.rows_shown] == [3, 2, 1]
        assert table.rows_shown[1]["weights"] == "REPACK (missing)"
        app.screen.query_one("#history-filter").value = "error"
        await pilot.pause()
        assert [r["pid"] for r in table.rows_shown] == [2]


def test_one_progress_line_with_elapsed_eta_and_what_now():
    p = Progress("prepack", "bytes", rate=100e6, started=-5.0)
    p.update(0, 1e9, t=0.0)
    p.update(10e6, 1e9, now="layer 1/5 attn", t=0.1)  # too short a span to measure a rate by
    line = p.line(t=0.15)  # the earlier runs' rate, counting down since the last sample
    assert line.startswith("prepack · 9.5 MiB / 953.7 MiB · 5s elapsed · ETA 10s (history at 95.4 MiB/s)")
    assert line.endswith("now: layer 1/5 attn")
    p.update(500e6, 1e9, t=10.0)
    assert p.eta(t=10.0) == (10.0, "measured at 47.7 MiB/s")  # once a span measured it: the rate here
    compile_ = Progress("compile", "programs", items={"a": 10.0, "b": 20.0}, started=0.0)
    compile_.update(1, 2, item="a")
    assert compile_.eta(t=12.0) == (20.0, "history")
    assert fmt.duration(3725) == "1h02m" and fmt.duration(65) == "1m05s"


def test_tables_are_tab_separated_and_unwrapped_when_stdout_is_not_a_terminal(capsys):
    long = "layer.sliding.decode/" + "f" * 64
    print_table("t", ("program", "state"), [(long, "stale: torch 2.12.0 → 2.13.0")])
    out = capsys.readouterr().out.splitlines()
    assert out == ["program\tstate", f"{long}\tstale: torch 2.12.0 → 2.13.0"]


def test_version_environment_and_completion():
    def run(*argv: str) -> str:
        return subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=60).stdout

    assert run("console.cli", "--version").startswith("dsv4 ")
    assert run("console.tui.app", "--version").startswith("dsv4-console ")
    for module in ("console.cli", "console.tui.app"):
        assert "DSV4_KERNEL_CACHE_DIR" in run(module, "--help") and "DSV4_STATE_DIR" in run(module, "--help")
    script = run("console.cli", "completion", "bash")
    assert "sidecar" in script and "serve" in script and "complete" in script



@pytest.mark.asyncio
async def test_z_maximises_the_focused_pane_and_restores_it():
    app = fake_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        await pilot.press("z")
        assert app.screen.maximized is app.query_one("#programs")
        await pilot.press("z")
        assert app.screen.maximized is None


def test_the_detail_of_a_sidecar_lists_the_source_key_it_was_packed_from(tiny_ckpt):
    from runtime.weights.prepack import prepack
    from store import sidecar

    prepack(tiny_ckpt, ranks=1)
    path = sidecar.default_sidecar_path(tiny_ckpt, 1)
    text = as_text(describe("sidecars", {"path": str(path), "verdict": "MAP"}))
    assert "source key recorded in the file" in text and "config" in text


@pytest.mark.asyncio
async def test_the_collapsed_layout_keeps_the_running_phase_residency_and_the_port():
    """Below 120×36 a pane is its title and one line: the Registration line is the running
    phase (n/total), the Sidecars title names residency, and the top bar reaches the port."""
    from console.data.launch_state import LaunchState
    from console.tui.panes.sidecars import SidecarsPane
    from runtime.events import Event

    launch = LaunchState()
    launch.apply(Event("check", "start"))
    launch.apply(Event("check", "end", seconds=0.1))
    launch.apply(Event("programs", "start"))
    launch.apply(Event("programs", "progress", done=1, total=4, detail={"program": "a"}))
    app = fake_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        app.launch = launch
        app.show_registration()
        await pilot.pause()
        first = str(app.query_one("#registration-summary", Static).render()).splitlines()[0]
        sidecars = app.query_one(SidecarsPane).border_title
        top = str(app.query_one("#topbar", Static).render())
    assert first.startswith("programs · 1/4 · ")
    assert "75% resident · next launch MAP" in sidecars
    assert top.index(":8000") < 80 and "/models/tiny" not in top and "model tiny" in top


def test_width_goes_to_the_text_that_needs_it_and_what_is_left_to_the_last_column():
    from console.tui.tables import GAP, Column, fit

    cols = (Column("a", "a", 5, essential=True), Column("b", "b", 10), Column("c", "why", 10))
    cut = fit(cols, 60, {"a": 3, "b": 30, "c": 50})  # a needs less than declared; b and c are cut at theirs
    assert [c.width for c in cut] == [3, 30, 21] and sum(c.width + GAP for c in cut) == 60
    short = fit(cols, 60, {"a": 1, "b": 2, "c": 3})
    assert [c.width for c in short] == [1, 2, 51]
    assert [c.key for c in fit(cols, 12, {"a": 5, "b": 10, "c": 10})] == ["a"]  # only the essential one fits


@pytest.mark.asyncio
async def test_a_column_that_repeats_another_is_hidden_and_the_last_one_reaches_the_edge():
    app = fake_app()
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        sidecars = app.query_one("#sidecars-table", PaneTable)
        programs = app.query_one("#programs-table", PaneTable)
        labels = [str(c.label) for c in sidecars.columns.values()]
        widths, room = sum(c.width + 2 for c in programs.columns.values()), programs.size.width
        why = str(programs.get_row_at(0)[-1])
    assert "verdict" not in labels and "next launch" in labels  # every verdict says what "next launch" says
    assert widths == room and why == "program.pt2: sha256 mismatch"


def test_details_read_like_kubectl_describe(tmp_path):
    """None is "-", times are local with their age, sizes and durations carry units, nested
    mappings indent under their key, and a manifest's key is one line per component."""
    import json
    import time

    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "manifest.json").write_text(json.dumps({
        "created": NOW - 7200, "compile_seconds": 28.6, "compile_peak_rss": 471859200,
        "files": [{"name": "program.pt2", "size": 3216195}],
        "key": [["backend", "aoti"], ["signature", {"dims": {"T": [1, 256]}}]]}))
    row = {"program": "head", "entry": str(entry), "residency": None, "changes": [], "sampled_at": NOW - 45,
           "size_bytes": 8 << 20, "mtime_ns": int((NOW - 30) * 1e9), "seconds": 125.0,
           "engine": {"steps": 812, "acceptance": 0.61}, "from_console": True, "cells": {"x": "hidden"}}
    text = as_text(describe("programs", row, now=NOW))
    local = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(NOW - 45))
    got = {line.split(":[/]")[0].strip().removeprefix("[b]"): line.split(":[/]", 1)[1].strip()
           for line in text.splitlines() if ":[/]" in line}
    assert got["residency"] == "-" and got["changes"] == "-" and "cells" not in got
    assert got["sampled_at"] == f"{local} (45s ago)" and got["mtime_ns"].endswith("(30s ago)")
    assert got["size_bytes"] == "8.0 MiB (8,388,608 bytes)" and got["seconds"] == "125 s (2m05s)"
    assert got["from_console"] == "yes" and got["engine"] == "" and "  [b]steps:[/]" in text
    assert got["acceptance"] == "61%" and got["steps"] == "812"
    assert got["compile_seconds"] == "28.60 s" and got["compile_peak_rss"].startswith("450.0 MiB")
    assert got["created"].endswith("(2h ago)") and got["backend"] == "aoti"
    assert got["signature"] == '{"dims":{"T":[1,256]}}' and "[b]- name:[/]" in text


@pytest.mark.asyncio
async def test_the_filter_gives_focus_back_enter_keeps_it_and_esc_clears_it():
    app = fake_app()
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        await pilot.press("tab")  # Services
        services = app.query_one("#services-table", PaneTable)
        assert app.focused is services
        await pilot.press("slash", *"stale", "enter")
        await pilot.pause()
        kept, focus_after_enter = app.needle, app.focused
        await pilot.press("slash", "escape")
        await pilot.pause()
        cleared, focus_after_esc = app.needle, app.focused
        title = str(app.query_one("#programs").border_title)
    assert kept == "stale" and focus_after_enter is services
    assert cleared == "" and focus_after_esc is services and title.startswith("Programs 4")


@pytest.mark.asyncio
async def test_a_warm_compile_shows_in_the_programs_pane_and_says_where_each_program_is():
    from types import SimpleNamespace

    from rich.text import Text

    from console.data.eta import follow
    from console.fleet.runner import HostJob
    from runtime.events import Event

    app = fake_app()
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        job = HostJob("warm", step="warm (compile)", progress=Progress("compile", "programs"),
                      command=SimpleNamespace(name="warm", running=True, pid=1))

        def plain(cell) -> str:
            return Text.from_markup(str(cell)).plain
        for program, state in (("layer.csa.prefill", "compiling"), ("head", "queued"),
                               ("layer.sliding.decode", "published")):
            event = Event("programs", "log", detail={"program": program, "state": state})
            job.pool = follow(job.progress, job.pool, event)  # as the runner moves a job by its events
            app.session.runner._moved(app.host.name, job, event)
        await pilot.pause()
        table = app.query_one("#programs-table", PaneTable)
        states = {str(table.get_row_at(i)[0]): plain(table.get_row_at(i)[1]) for i in range(table.row_count)}
        job = str(app.query_one("#programs-job Static").render())
        elsewhere = app.query_one("#sidecars-job").display
        app.progress.pop("warm")
        app.jobs_control.job_pane(Progress("compile", "programs")).job("")  # as the job's end does
        await pilot.pause()
        after = {str(table.get_row_at(i)[0]): plain(table.get_row_at(i)[1]) for i in range(table.row_count)}
    assert states == {"layer.csa.prefill": "compiling", "head": "queued", "layer.sliding.decode": "published",
                      "layer.sliding.prefill": "HIT"}
    assert job.startswith("compile") and "now: compiling layer.csa.prefill" in job
    assert elsewhere is False and after["layer.csa.prefill"] == "MISS"


def test_the_host_pane_labels_each_core_and_sums_up_a_big_host():
    from console.tui.panes.host import cores_line, scale

    assert cores_line((20.0, 27.4)) == "cores c0 20% c1 27%"
    big = tuple(95.0 if i in (3, 7) else 10.0 for i in range(192))
    assert cores_line(big) == "192 cores: busiest c3 95% · median 10% · 2 at 90%+"
    assert scale((5.0, 80.0, 12.0), "%") == "5–80%" and scale((), "%") == "-"
    assert scale((0.0, 12e6), " MB/s", 1e6, 1) == "0.0–12.0 MB/s"


# ---- what the compact layout keeps, an ended service's last log lines, launches compared ----


def _launch_done(predicted: dict, actual: dict):
    """A launch whose every registration phase ended, with the plan's prediction it carried."""
    from console.data.launch_state import LaunchState
    from runtime.events import REGISTRATION, Event

    state = LaunchState()
    plan = {"predicted": predicted, "basis": {p: "history" for p in predicted}}
    for phase in REGISTRATION:
        state.apply(Event(phase, "start"))
        state.apply(Event(phase, "end", seconds=actual[phase], detail={"plan": plan} if phase == "check" else {}))
    return state


@pytest.mark.asyncio
async def test_the_collapsed_registration_keeps_predicted_vs_actual_first():
    seconds = {"check": 0.1, "programs": 2.0, "weights": 1.0, "upload": 0.1, "kv": 0.1, "validate": 0.7}
    launch = _launch_done(seconds, {**seconds, "programs": 2.5})
    app = fake_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        app.launch = launch
        app.show_registration()
        await pilot.pause()
        first = str(app.query_one("#registration-summary", Static).render()).splitlines()[0]
    # the registration span on both sides: programs ∥ weights, the longer counts (not their sum, 4.00 · 4.50)
    assert first.startswith("registration predicted 3.00 s · actual 3.50 s (+17%)")


@pytest.mark.asyncio
async def test_the_collapsed_header_keeps_the_url_of_the_running_service():
    from types import SimpleNamespace

    from runtime.events import Event

    seconds = {"check": 0.1, "programs": 2.0, "weights": 1.0, "upload": 0.1, "kv": 0.1, "validate": 0.7}
    launch = _launch_done(seconds, seconds)
    launch.apply(Event("serve", "end", seconds=0.1, detail={"url": "http://127.0.0.1:18701"}))
    app = fake_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        app.service_control.held = SimpleNamespace(running=True, pid=41234, identity=None)
        app.launch = launch
        app.topbar()
        await pilot.pause()
        top = app.query_one("#topbar", Static)
        shown = top.render_line(0).text  # what the 80 columns show
    assert "service pid 41234 http://127.0.0.1:18701" in shown


@pytest.mark.asyncio
async def test_collapsed_services_keep_each_services_state_and_tokens_s():
    import dataclasses

    from console_fakes import snapshot

    from console.data.services import ServicesSnapshot, ServiceView
    from store.services import Ending

    snap = snapshot()
    serving = snap.services.services[0]
    ended = ServiceView(dataclasses.replace(serving.record, pid=4300, state="ended",
                                            ending=Ending(NOW - 12, "killed by SIGKILL", "serve", by="console")),
                        "ended")
    app = fake_app(collectors=FakeCollectors(dataclasses.replace(snap, services=ServicesSnapshot((serving, ended)))))
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.pause()
        summary = app.query_one("#services-summary", Static)
        first = str(summary.render()).splitlines()[0]
        seen = summary.render_line(0).text
    assert first == "4242 serving 182 tok/s · 4300 ended" and first in seen


@pytest.mark.asyncio
async def test_an_ended_services_summary_and_details_keep_its_last_log_lines():
    import dataclasses

    from console_fakes import snapshot
    from rich.text import Text

    from console.data.services import ServicesSnapshot, ServiceView
    from store.services import Ending

    snap = snapshot()
    tail = ("validate: decode check ok", "serving at [http://127.0.0.1:8000]", "Fatal Python error: Bus error",
            "Current thread 0x00007f (most recent call first):", '  File "runtime/engine/engine.py", line 88')
    record = dataclasses.replace(snap.services.services[0].record, state="ended",
                                 ending=Ending(NOW - 12, "killed by SIGBUS", "serve", by="console", log=tail))
    app = fake_app(collectors=FakeCollectors(dataclasses.replace(snap, services=ServicesSnapshot(
        (ServiceView(record, "ended"),)))))
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        summary = str(app.query_one("#services-summary", Static).render())
        app.query_one("#services-table").focus()
        await pilot.press("enter")
        await pilot.pause()
        details = Text.from_markup(app.screen.text).plain
    assert f"last log: {tail[-1]}" in summary and "its last 5 lines" in summary
    assert "\n".join(f"    {line}" for line in tail) in details  # each line as written, under the ending


def test_a_re_attached_launch_is_never_compared_with_itself():
    """Re-attaching, the last record is the running launch's own (it recorded "ok" as it
    served): the launch is compared with the one before it."""
    import dataclasses
    from types import SimpleNamespace

    from console_fakes import record, snapshot

    from console.data.records import LaunchRecord
    from console.tui.control.service import ServiceControl

    snap = snapshot()
    spawned = NOW - 100
    own = LaunchRecord.of({**record(0.5, pid=4242), "started": spawned + 0.2})
    before = LaunchRecord.of(record(0.6, pid=4100))
    snap = dataclasses.replace(snap, registration=dataclasses.replace(snap.registration, previous=own, earlier=before))
    control = ServiceControl(SimpleNamespace(snapshot=snap), stop_timeout=10)
    assert control.new_launch(spawned=spawned).compared is before
    assert control.new_launch().compared is own  # a new launch: the last one is another's


def test_deltas_under_a_tenth_of_a_second_are_seconds_not_shares():
    from console.data.launch_state import delta

    assert delta(0.048, 0.010) == "+0.04 s" and delta(0.010, 0.048) == "−0.04 s"  # not +380 %
    assert delta(2.5, 2.0) == "+25%" and delta(1.0, 2.0) == "−50%" and delta(None, 1.0) == ""


def test_a_sparkline_scales_the_last_values_to_their_peak_and_says_it():
    assert fmt.spark([0, 4, 8]) == "▁▅█ 8" and fmt.spark([0.0, 0.0]) == "▁▁ 0" and fmt.spark([]) == "-"
    bars, top = fmt.spark(range(100), 8).split()
    assert len(bars) == 8 and bars[-1] == "█" and top == "99"
    assert fmt.spark([1.2] * 4) == "████ 1.2" and fmt.spark([2.0, 1.2]).endswith(" 2")  # the scale tells them apart
    assert fmt.spark([100.0] * 3, top=100) == "███ 100" and fmt.spark([50.0], top=100) == "▅ 50"  # a percent: 0..100
    assert fmt.bars([100.0] * 3, 12, top=100) == "█" * 12  # the Host pane's CPU at 100 %: full, not ▁▁▁
    assert fmt.bars([0.0, 100.0], 4, top=100) == "▁▁██" and fmt.bars([50.0] * 2, 2, top=100) == "▅▅"


def test_a_stale_cache_entrys_details_keep_the_raw_key_difference_under_the_sentence():
    from console_fakes import cache_snapshot

    [entry] = [e for e in cache_snapshot().entries if e.state == "other-layout"]
    text = as_text(describe("cache", entry.to_json(), now=NOW))
    assert "layout's max_seq is 1024 here; this launch uses 64" in text
    assert '[b]key difference:[/]\n  [b]layout:[/]  {"max_seq":1024} → {"max_seq":64}' in text
