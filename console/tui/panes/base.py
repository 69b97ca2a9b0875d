"""The base of every pane: a bordered box that `z` can maximise and the compact layout
collapses to its title and one summary line."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.containers import Vertical


class Pane(Vertical):
    ALLOW_MAXIMIZE: ClassVar[bool | None] = True

    def __init__(self, **kw: Any) -> None:
        super().__init__(classes="pane", **kw)
