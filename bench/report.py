"""How benchmarks print: rich tables for people, JSON for scripts (bench never imports console/)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")


def print_table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                width: int | None = None) -> None:
    """`width`: the table's, whatever the terminal's (a wide table is folded into narrow columns
    otherwise; a pipe counts as 80)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, header_style="bold")
    for c in columns:
        table.add_column(c, overflow="fold")
    for r in rows:
        table.add_row(*("" if v is None else str(v) for v in r))
    Console(width=width).print(table)
