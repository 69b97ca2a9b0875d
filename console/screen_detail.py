"""Enter on a row: everything the row knows, in full (path, key, manifest, why)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

from rich.markup import escape
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

MAX_MANIFEST_BYTES = 1 << 20


def _manifest(row: dict[str, Any]) -> str:
    """A program entry's manifest (the full key), bounded: never a multi-GB read."""
    if not row.get("entry"):
        return ""
    path = Path(row["entry"]) / "manifest.json"
    try:
        if not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
            return ""
        return json.dumps(json.loads(path.read_bytes()), indent=2)
    except (OSError, ValueError):
        return ""


def describe(pane: str, row: dict[str, Any]) -> str:
    hidden = {"cells", "cmdline"}
    lines = [f"[b]{escape(str(k))}[/]  {escape(str(v))}" for k, v in row.items() if k not in hidden]
    if "cmdline" in row:
        lines.append(f"[b]cmdline[/]  {escape(' '.join(row['cmdline']))}")
    if pane == "programs":
        manifest = _manifest(row)
        lines += ["", "[b]manifest.json[/]", escape(manifest) if manifest else "[dim](unreadable or absent)[/]"]
    return "\n".join(lines)


class DetailScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,enter", "close", "Close", id="detail.close")]

    def __init__(self, pane: str, row: dict[str, Any]) -> None:
        super().__init__()
        self.pane, self.row = pane, row
        self.text = describe(pane, row)

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="detail"):
            yield Static(f"[b]{self.pane}[/] [dim](esc closes)[/]", id="detail-title")
            yield Static(self.text, id="detail-body")

    def action_close(self) -> None:
        self.dismiss(None)
