"""Worker output as Textual messages: each event and line of a command a console runs
(`console.fleet.command`) posted to the app, handled on its event loop."""

from __future__ import annotations

from typing import Any

from textual.message import Message

from console.fleet.command import (
    STDERR_TAIL,
    STOP_TIMEOUT,
    LineFilter,
    Worker,
    dsv4,
    service_argv,
    shown,
)
from runtime.events import Event

__all__ = ["STDERR_TAIL", "STOP_TIMEOUT", "LineFilter", "Worker", "WorkerEvent", "WorkerLine", "dsv4",
           "service_argv", "shown"]


class WorkerEvent(Message):
    """An event from a worker process (a job, or the service this console holds)."""

    def __init__(self, worker: Any, event: Event) -> None:
        super().__init__()
        self.worker, self.event = worker, event


class WorkerLine(Message):
    """A log line from a worker process."""

    def __init__(self, worker: Any, which: str, line: str) -> None:
        super().__init__()
        self.worker, self.which, self.line = worker, which, line
