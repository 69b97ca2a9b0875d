"""A byte-progress bar for long CLI work (rich, on stderr, only on a terminal)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def byte_progress(description: str, enabled: bool = True) -> Iterator[Callable[[int, int, str], None]]:
    """Yield `update(done, total, label)`; draws a transfer bar with speed and ETA on a TTY."""
    if not (enabled and sys.stderr.isatty()):
        yield lambda done, total, label: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
               TransferSpeedColumn(), TimeRemainingColumn(), TextColumn("[dim]{task.fields[label]}"))
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None, label="")

        def update(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, label=label[-48:])

        yield update
