"""The `/` filter box, the console's one filter, on the one-host screen and the fleet screen:
what is typed filters the shown screen's rows (every pane's and the log, or the hosts: the app
applies the needle on each `Input.Changed`); enter keeps the filter and closes the box, esc
clears both; focus goes back to where it was."""

from __future__ import annotations

from typing import Any

from textual.widgets import Input


class FilterBox(Input):
    def __init__(self) -> None:
        super().__init__(placeholder="filter (enter keeps it, esc clears it)", id="filter")
        self._before: Any = None  # the widget focused when the box opened

    def open(self) -> None:
        if self.app.focused is not self:  # where focus goes back to when the box closes
            self._before = self.app.focused
        self.display = True
        self.focus()

    def clear_and_close(self) -> None:
        self.value = ""
        self.close()

    def close(self) -> None:
        self.display = False
        back, self._before = self._before, None
        if back is None or not back.is_attached or not back.display:
            tables = self.screen.query("DataTable")
            back = tables.first() if tables else None
        if back is not None:
            back.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.close()  # enter: the filter stays, the box closes
