"""The Log pane keeps its lines whole while another pane is zoomed (issue 71: a line written then
was stored one character per row until `/` redrew it)."""

from __future__ import annotations

import pytest
from console_fakes import fake_app
from textual.widgets import RichLog


@pytest.mark.asyncio
async def test_a_line_written_while_another_pane_is_zoomed_is_one_row_after_the_zoom():
    app = fake_app()
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        log = app.query_one("#log", RichLog)
        app.log_line("console", "before the zoom")
        app.query_one("#programs-table").focus()
        await pilot.press("z")
        await pilot.pause()
        assert log.scrollable_content_region.width < 2  # hidden: what the old code wrapped lines to
        app.log_line("console", "a line written while another pane is zoomed")
        await pilot.press("z")
        await pilot.pause()
        await pilot.pause()
        assert [strip.text for strip in log.lines] == [
            "console before the zoom", "console a line written while another pane is zoomed"]
        app.query_one("#programs-table").focus()  # a filter typed while zoomed redraws only once shown
        await pilot.press("z")
        app.query_one("#logpane").filter("zoomed")
        await pilot.press("z")
        await pilot.pause()
        await pilot.pause()
        assert [strip.text for strip in log.lines] == ["console a line written while another pane is zoomed"]
