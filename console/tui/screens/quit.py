"""Quit while a service this console started is running: leave it running, stop it, or stay."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

LEAVE, STOP, CANCEL = "leave", "stop", "cancel"


class QuitScreen(ModalScreen[str]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("l", "answer('leave')", "Leave running", id="quit.leave"),
        Binding("s", "answer('stop')", "Stop it", id="quit.stop"),
        Binding("escape,c", "answer('cancel')", "Cancel", id="quit.cancel"),
    ]

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static("[b]A service started here is running[/]", id="dialog-title")
            yield Static(self.what, id="dialog-body")
            with Horizontal(id="dialog-buttons"):
                yield Button("Leave running (l)", id=LEAVE)
                yield Button("Stop it (s)", variant="error", id=STOP)
                yield Button("Cancel (esc)", variant="primary", id=CANCEL)

    def on_mount(self) -> None:
        self.query_one(f"#{CANCEL}", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or CANCEL)

    def action_answer(self, choice: str) -> None:
        self.dismiss(choice)
