"""SVG snapshots of the console over fake collectors at the sizes operators use
(pytest-textual-snapshot; regenerate with `pytest --snapshot-update` after a deliberate change)."""

from __future__ import annotations

import pytest
from console_fakes import SPEC, FakeCollectors, snapshot

from console.tui.app import Dsv4Console


def _app(**kw) -> Dsv4Console:
    return Dsv4Console(SPEC, host=FakeCollectors(kw.pop("snap", None)), watch=False,
                       create_default=False, interval=0, **kw)


@pytest.mark.parametrize("size", [(200, 50), (120, 36), (100, 30), (80, 24)],
                         ids=["200x50", "120x36", "100x30", "80x24"])
def test_main_screen(snap_compare, size):
    assert snap_compare(_app(), terminal_size=size)


def test_compact_layout_expands_the_focused_pane(snap_compare):
    # tab to Services: in the compact layout the focused pane takes the room, others keep a line
    assert snap_compare(_app(), press=["tab"], terminal_size=(80, 24))


def test_main_screen_readonly_with_a_starving_kv_budget(snap_compare):
    assert snap_compare(_app(readonly=True, snap=snapshot(starving=True)), terminal_size=(200, 50))


def test_help_screen(snap_compare):
    assert snap_compare(_app(), press=["question_mark"], terminal_size=(100, 30))


def test_detail_of_a_program_entry(snap_compare):
    assert snap_compare(_app(), press=["enter"], terminal_size=(100, 30))


def test_kernel_cache_contents_one_key_away(snap_compare):
    assert snap_compare(_app(), press=["c"], terminal_size=(200, 50))


def test_filter_names_n_of_m_in_every_pane(snap_compare):
    assert snap_compare(_app(), press=["slash", *"stale", "enter"], terminal_size=(200, 50))
