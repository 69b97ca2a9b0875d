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


def _manifest(entry: str | None) -> str:
    """A program entry's manifest (the full key), bounded: never a multi-GB read."""
    if not entry:
        return ""
    path = Path(entry) / "manifest.json"
    try:
        if not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
            return ""
        return json.dumps(json.loads(path.read_bytes()), indent=2)
    except (OSError, ValueError):
        return ""


def _source_key(row: dict[str, Any]) -> str:
    """The source key a sidecar file records (what it was packed from), component by component."""
    import os
    import stat

    from store.sidecar.format import sound_header

    try:
        fd = os.open(row["path"], os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, KeyError):
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ""
        _, key, _, _ = sound_header(fd, st.st_size)
        return "\n".join(f"  {name}: {json.dumps(value, default=str)[:200]}" for name, value in key.components)
    except Exception as e:  # a corrupt header is the verdict's business; here it is one line
        return f"  (unreadable: {type(e).__name__}: {e})"[:200]
    finally:
        os.close(fd)


def describe(pane: str, row: dict[str, Any]) -> str:
    hidden = {"cells", "cmdline"}
    lines = [f"[b]{escape(str(k))}[/]  {escape(str(v))}" for k, v in row.items() if k not in hidden]
    if "cmdline" in row:
        lines.append(f"[b]cmdline[/]  {escape(' '.join(row['cmdline']))}")
    if pane in ("programs", "cache"):
        manifest = _manifest(row.get("entry") if pane == "programs" else row.get("path"))
        lines += ["", "[b]manifest.json[/]", escape(manifest) if manifest else "[dim](unreadable or absent)[/]"]
    if pane == "sidecars":
        key = _source_key(row)
        lines += ["", "[b]source key recorded in the file[/]", escape(key) if key else "[dim](no file)[/]"]
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
