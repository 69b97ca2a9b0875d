"""Console habits an operator expects: sizes, the log, sorting, details, the palette, the
history view, progress lines, plain tables, `--version`, completion (fake collectors)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from console_fakes import NOW, FakeCollectors, fake_app
from textual.widgets import RichLog, Static

from console.cli.output import print_table
from console.tui import fmt
from console.tui.app import MUTATING
from console.tui.data.eta import Progress
from console.tui.screens.detail import DetailScreen, describe
from console.tui.screens.history import HistoryScreen
from console.tui.tables import PaneTable
from console.tui.workers import LineFilter

REPO = Path(__file__).resolve().parents[1]


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
        assert [r["state"] for r in table.rows_shown] == ["HIT", "STALE", "CORRUPT", "MISS"]  # the plan's order
        await pilot.press("o")
        assert [r["program"] for r in table.rows_shown] == sorted(r["program"] for r in table.rows_shown)
        await pilot.press("o")  # next column: state
        assert [r["state"] for r in table.rows_shown] == sorted(r["state"] for r in table.rows_shown)
        await pilot.press("O")
        assert [r["state"] for r in table.rows_shown] == sorted((r["state"] for r in table.rows_shown), reverse=True)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, DetailScreen)
        assert f"[b]fingerprint[/]  {table.rows_shown[0]['fingerprint']}" in app.screen.text  # in full
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
    collectors.history = lambda: records
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
    p = Progress("prepack", "bytes", rate=100e6, started=0.0)
    p.update(10e6, 1e9, now="layer 1/5 attn")
    line = p.line(t=5.0)
    assert line.startswith("prepack · 9.5 MiB / 953.7 MiB · 5s elapsed · ETA 10s (history)")
    assert line.endswith("now: layer 1/5 attn")
    p.update(500e6, 1e9)
    assert p.eta(t=50.0) == (50.0, "measured")  # past the first tenth: the rate measured here
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
    text = describe("sidecars", {"path": str(path), "verdict": "MAP"})
    assert "source key recorded in the file" in text and "config" in text
