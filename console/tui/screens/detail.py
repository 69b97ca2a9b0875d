"""Enter on a row: everything the row knows, in full (path, key, manifest, why), laid out like
`kubectl describe`: aligned keys, "-" for none, local times with their age, sizes and durations
in units, nested mappings indented under their key, a key's components one per line."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from console import fmt
from store.units import format_age, format_size

MAX_MANIFEST_BYTES = 1 << 20
# a number under one of these keys is a unix time: shown local, with its age
TIME_KEYS = frozenset({"created", "last_used", "last_hit", "sampled_at", "started", "create_time", "when", "ended",
                       "spawned", "ts", "mtime"})
FRACTION_KEYS = frozenset({"residency", "fraction", "utilization", "acceptance"})
# the pane's rendering of the row, not what the row knows
HIDDEN = frozenset({"cells", "view", "value", "reading", "service"})
LINES = frozenset({"log"})  # a list of text lines under one of these keys: one line each, as written
Row = tuple[int, str, str | None]  # (depth, key, value in words); no value: a heading of what follows


def _when(t: float, now: float) -> str:
    local = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    return f"{local} ({format_age(now - t)} ago)" if now >= t else f"{local} (in {format_age(t - now)})"


def _scalar(key: str, v: Any, now: float) -> str:
    """One value in words: "-" for none, times local with their age, sizes and durations in units."""
    if v is None or v == "" or v == [] or v == {}:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int | float):
        if key.endswith("_ns") and "time" in key and v > 0:
            return _when(v / 1e9, now)
        if (key in TIME_KEYS or key.endswith(("_at", "_time"))) and v > 1e8:
            return _when(v, now)
        if key in ("size", "bytes") or key.endswith(("_bytes", "_rss", "_size")):
            return f"{format_size(v)} ({v:,} bytes)" if v >= 1024 else f"{v} bytes"
        if key == "seconds" or key.endswith(("_seconds", "_s")):
            return f"{v:.2f} s" if v < 60 else f"{v:.0f} s ({fmt.duration(v)})"
        if key in FRACTION_KEYS or key.endswith("_fraction"):
            return f"{v:.0%}"
        return f"{v:g}" if isinstance(v, float) else str(v)
    if isinstance(v, list | tuple):
        return (" " if key == "cmdline" else ", ").join(str(x) for x in v)
    return str(v)


def _components(v: Any) -> bool:
    """A key as [name, value] pairs (a manifest's `key`, a sidecar's source key)."""
    return isinstance(v, list | tuple) and bool(v) and all(
        isinstance(c, list | tuple) and len(c) == 2 and isinstance(c[0], str) for c in v)


def rows(data: dict[str, Any], now: float, depth: int = 0) -> list[Row]:
    """`data` as rows: nested mappings under their key, lists of mappings as `-` items, a key's
    components one per line (a structured value as one line of compact JSON)."""
    out: list[Row] = []
    for k, v in data.items():
        k = str(k)
        if k in HIDDEN:
            continue
        if isinstance(v, dict) and v:
            out += [(depth, k, None), *rows(v, now, depth + 1)]
        elif k in LINES and isinstance(v, list | tuple) and v and all(isinstance(x, str) for x in v):
            out += [(depth, k, None), *((depth + 1, "", line) for line in v)]
        elif _components(v):
            out.append((depth, k, None))
            out += [(depth + 1, name, json.dumps(value, separators=(",", ":"), default=str)
                     if isinstance(value, dict | list | tuple) else _scalar(name, value, now)) for name, value in v]
        elif isinstance(v, list) and any(isinstance(x, dict) for x in v):
            out.append((depth, k, None))
            for item in v:
                sub = rows(item, now, depth + 1) if isinstance(item, dict) else [(depth + 1, str(item), "")]
                out += [(d, ("- " if i == 0 else "  ") + key if d == depth + 1 else key, value)
                        for i, (d, key, value) in enumerate(sub)]
        else:
            out.append((depth, k, _scalar(k, v, now)))
    return out


def as_text(described: list[Row]) -> str:
    """Rows as console markup, one a line (what the screen holds as `text`)."""
    return "\n".join(f"{'  ' * d}" + (f"[b]{escape(k)}:[/]" + (f"  {escape(v)}" if v is not None else "")
                                        if k else escape(v or "")) for d, k, v in described)


def as_renderable(described: list[Row]) -> RenderableType:
    """Rows laid out: each run of keys at one depth aligned, a long value folded in its column."""
    parts: list[RenderableType] = []
    block: list[Row] = []

    def flush() -> None:
        if block:
            grid = Table.grid(padding=(0, 2))
            grid.add_column(no_wrap=True, style="bold")
            grid.add_column(overflow="fold")
            for _, k, v in block:
                grid.add_row(f"{k}:" if k else "", Text(v or ""))
            parts.append(Padding(grid, (0, 0, 0, 2 * block[0][0])))
            block.clear()

    for d, k, v in described:
        if block and block[0][0] != d:
            flush()
        if v is None:
            flush()
            parts.append(Padding(Text(f"{k}:", style="bold"), (0, 0, 0, 2 * d)))
        else:
            block.append((d, k, v))
    flush()
    return Group(*parts)


def _manifest(entry: str | None) -> dict[str, Any] | None:
    """A program entry's manifest (the full key), bounded: never a multi-GB read."""
    if not entry:
        return None
    path = Path(entry) / "manifest.json"
    try:
        if not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
            return None
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _source_key(row: dict[str, Any]) -> list[tuple[str, Any]] | str:
    """The source key a sidecar file records (what it was packed from), or why there is none."""
    import os
    import stat

    from store.sidecar.format import sound_header

    try:
        fd = os.open(row["path"], os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, KeyError):
        return "no file"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        _, key, _, _ = sound_header(fd, st.st_size)
        return list(key.components)
    except Exception as e:  # a corrupt header is the verdict's business; here it is one line
        return f"unreadable: {type(e).__name__}: {e}"[:200]
    finally:
        os.close(fd)


def describe(pane: str, row: dict[str, Any], now: float | None = None) -> list[Row]:
    """A row of `pane` in full, with what its files record (a program's manifest, a sidecar's key)."""
    now = time.time() if now is None else now
    out = rows(row, now)
    if pane in ("programs", "cache"):
        manifest = _manifest(row.get("entry") if pane == "programs" else row.get("path"))
        out += rows({"manifest.json": manifest}, now) if manifest else [(0, "manifest.json", "unreadable or absent")]
    if pane == "sidecars":
        key = _source_key(row)
        out += rows({"source key recorded in the file": key}, now) if isinstance(key, list) else [
            (0, "source key recorded in the file", key)]
    return out


class DetailScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,enter", "close", "Close", id="detail.close")]

    def __init__(self, pane: str, row: dict[str, Any]) -> None:
        super().__init__()
        self.pane, self.row = pane, row
        self.described = describe(pane, row)
        self.text = as_text(self.described)

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="detail"):
            yield Static(f"[b]{self.pane}[/] [dim](esc closes)[/]", id="detail-title")
            yield Static(as_renderable(self.described), id="detail-body")

    def action_close(self) -> None:
        self.dismiss(None)
