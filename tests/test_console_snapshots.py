"""SVG snapshots of the console's main and help screens over fake collectors
(pytest-textual-snapshot; regenerate with `pytest --snapshot-update` after a deliberate change)."""

from __future__ import annotations

from pathlib import Path

from console_fakes import FakeCollectors, snapshot

from console.app import Dsv4Console
from console.collectors import Settings

SIZE = (180, 48)


def _app(**kw) -> Dsv4Console:
    settings = Settings(Path("/models/tiny"), Path("/cache"), device="cpu", backend="eager", max_seq=64)
    return Dsv4Console(settings, collectors=FakeCollectors(kw.pop("snap", None)), watch=False,
                       create_default=False, interval=0, **kw)


def test_main_screen(snap_compare):
    assert snap_compare(_app(), terminal_size=SIZE)


def test_main_screen_readonly_with_a_starving_kv_budget(snap_compare):
    assert snap_compare(_app(readonly=True, snap=snapshot(starving=True)), terminal_size=SIZE)


def test_help_screen(snap_compare):
    assert snap_compare(_app(), press=["question_mark"], terminal_size=SIZE)
