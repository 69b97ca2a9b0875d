"""docs/cli.md is what the parsers and the launch-flag table say today (issue 70): a flag added or
a help text changed without regenerating the page fails here, naming the first lines that differ."""

from __future__ import annotations

import difflib
from pathlib import Path

from console.cli.reference import render

PAGE = Path(__file__).resolve().parents[3] / "docs" / "cli.md"


def test_the_cli_reference_is_regenerated_with_the_parsers():
    have, want = PAGE.read_text().splitlines(), render().splitlines()
    delta = list(difflib.unified_diff(have, want, "docs/cli.md", "render()", lineterm="", n=0))[:20]
    assert not delta, ("docs/cli.md is stale; run `python -m console.cli.reference > docs/cli.md`:\n"
                       + "\n".join(delta))


def test_every_launch_flag_and_command_is_in_the_reference():
    from console.cli import build_parser
    from runtime.launch.spec import FLAGS

    page = PAGE.read_text()
    assert all(f"| `{flag.flag}` |" in page for flag in FLAGS)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert all(f"## `dsv4 {name}`" in page for name in sub.choices)
