"""Output helpers shared by every CLI command: JSON for scripts, rich tables for people, and
plain tab-separated lines (never wrapped, never truncated) when stdout is not a terminal, so
`dsv4 cache ls | grep …` and `| cut -f2` work."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def _plain(value: Any) -> str:
    # a tab or newline inside a cell would split it into two fields or two rows
    return "" if value is None else str(value).replace("\t", " ").replace("\n", " ")


def print_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    if not sys.stdout.isatty():
        sys.stdout.write("\t".join(columns) + "\n")
        for r in rows:
            sys.stdout.write("\t".join(_plain(v) for v in r) + "\n")
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=False, header_style="bold")
    for c in columns:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*("" if v is None else str(v) for v in r))
    Console().print(table)


def confirm(yes: bool, question: str, refused: str = "nothing deleted") -> None:
    """Ask before deleting (or running on hosts): --yes answers; without a terminal to ask,
    refuse (one line); a no is `refused`."""
    from store.errors import UserError

    if yes:
        return
    if not sys.stdin.isatty():
        raise UserError(f"{question} pass --yes to confirm (stdin is not a terminal)")
    if input(f"{question} [y/N] ").strip().lower() not in ("y", "yes"):
        raise UserError(refused)
