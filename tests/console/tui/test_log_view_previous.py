"""`L` shows the service's own log file (not the one line its terminal output has), `p` there the
previous run's kept beside it, `p` again back (a fake snapshot; the log files are real)."""

from __future__ import annotations

import dataclasses

import pytest
from console_fakes import SPEC, FixedHost, snapshot

from console.data.services import ServicesSnapshot
from console.tui.app import Dsv4Console
from console.tui.screens.logview import LogScreen


@pytest.mark.asyncio
async def test_L_opens_the_services_log_file_and_p_the_previous_runs(tmp_path):
    output = tmp_path / "output.log"
    output.write_text("serving /models/tiny at http://127.0.0.1:8000 (Ctrl-C or SIGTERM to stop)\n")
    own = tmp_path / "serve-8000.log"
    own.write_text("".join(f"01:05:3{i} INFO  access 200 /v1/completions model tiny {i}\n" for i in range(5)))
    before = tmp_path / "serve-8000.prev.log"
    before.write_text("01:00:00 ERROR failed: rank 1 on host-b was killed by SIGKILL\n")
    snap = snapshot()
    view = snap.services.services[0]
    record = dataclasses.replace(view.record, log=str(output), log_file=str(own), previous_log=str(before))
    snap = dataclasses.replace(snap, services=ServicesSnapshot((dataclasses.replace(view, record=record),)))
    app = Dsv4Console(SPEC, host=FixedHost(snap), watch=False, create_default=False, interval=0)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        app.query_one("#services-table").focus()
        await pilot.press("L")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, LogScreen)
        assert len(screen.lines) == 5 and screen.lines[-1].endswith("model tiny 4")  # its log, every access line
        await pilot.press("p")
        await pilot.pause()
        assert screen.lines == ["01:00:00 ERROR failed: rank 1 on host-b was killed by SIGKILL"]
        assert "previous run" in screen.feeds[screen.which].label
        await pilot.press("p")
        await pilot.pause()
        assert screen.which == 0 and screen.lines[-1].endswith("model tiny 4")
