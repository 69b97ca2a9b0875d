"""The one-host screen's top line (`console.tui.topbar`): the settings as the plan resolved them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from console_fakes import SPEC, snapshot

from console.tui.topbar import topbar_line


def _app(spec, snap):
    idle = SimpleNamespace(running=False)
    return SimpleNamespace(spec=spec, snapshot=snap, service_control=idle, launch=None, host=None,
                           session=SimpleNamespace(alone=True), reading=None, readonly=False,
                           jobs_control=SimpleNamespace(running=lambda: []), jobs={}, service=None)


def test_the_top_line_says_the_backend_the_plan_resolved_not_auto():
    snap = snapshot()
    snap = dataclasses.replace(snap, plan=dataclasses.replace(snap.plan, backend="export"))
    line = topbar_line(_app(SPEC.with_(backend="auto"), snap), compact=False)
    assert "backend export" in line and "backend auto" not in line
    assert "backend auto" in topbar_line(_app(SPEC.with_(backend="auto"), None), compact=False)  # no plan yet
