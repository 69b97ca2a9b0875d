"""The CLI reference (docs/cli.md), generated from the parsers themselves and the launch-flag
table (`runtime.launch.spec.FLAGS`), so the manual cannot say what `--help` does not.

`python -m console.cli.reference > docs/cli.md` writes it; a test fails when the file differs
from what this prints (a flag added, a help text changed, a command renamed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator

HEADER = """# CLI reference

Generated from the parsers and the launch-flag table by `python -m console.cli.reference >
docs/cli.md`; `tests/console/cli/test_reference.py` fails when this page is stale. Every command
also answers `--help` (with the environment it reads).
"""


def _cell(text: object) -> str:
    """Text that stays inside one markdown table cell."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _formatter(parser: argparse.ArgumentParser) -> argparse.HelpFormatter:
    # one unwrapped line whatever the terminal: the page must not depend on who generated it
    return argparse.HelpFormatter(parser.prog, width=10_000, max_help_position=10_000)


def usage(parser: argparse.ArgumentParser) -> str:
    f = _formatter(parser)
    f.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return " ".join(f.format_help().split())


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    return _cell(_formatter(parser)._expand_help(action))


def _name(action: argparse.Action) -> str:
    if action.option_strings:
        names = ", ".join(action.option_strings)
        if action.nargs == 0:
            return names
        metavar = action.metavar or (action.dest.upper() if not action.choices else
                                     "{" + ",".join(map(str, action.choices)) + "}")
        return f"{names} {metavar}"
    return str(action.metavar or action.dest)


def _commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every subcommand under it, depth first, in `--help`'s order."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases name one parser twice
                yield from _commands(sub)


def command_section(parser: argparse.ArgumentParser, level: str = "##") -> list[str]:
    out = [f"{level} `{parser.prog}`", "", f"    {usage(parser)}", ""]
    if parser.description:
        out += [" ".join(parser.description.split()), ""]
    rows = [a for a in parser._actions
            if not isinstance(a, argparse._SubParsersAction | argparse._HelpAction) and a.help != argparse.SUPPRESS]
    if rows:
        out += ["| argument | what |", "|---|---|"]
        out += [f"| `{_cell(_name(a))}` | {_help(parser, a)} |" for a in rows]
        out.append("")
    return out


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def launch_flags() -> list[str]:
    from runtime.launch.spec import DEFAULTS_OF, FLAGS
    from store.units import format_size

    out = ["## Launch flags", "",
           "Every setting of a launch is one field of the launch spec (`runtime/launch/spec.py`), with one "
           "flag, one default and one allowed range; each command takes the fields it uses.", "",
           "| flag | default | allowed | commands | what |", "|---|---|---|---|---|"]
    for flag in FLAGS:
        default = DEFAULTS_OF[flag.field]
        if flag.negate or default is None:
            shown = "-"  # a switch is off until given; None: the help says what stands in
        else:
            shown = format_size(default) if flag.metavar == "SIZE" else flag.show(default)
        allowed = flag.allowed or (f"{_number(flag.lo)}..{_number(flag.hi)}" if flag.lo is not None else
                                   "|".join(flag.choices) if flag.choices else "")
        own = "".join(f"; {c}: {v}" for c, v in flag.defaults.items())
        text = flag.help.replace("%(default)s", str(default))
        out.append(f"| `{flag.flag}` | {_cell(shown + own)} | {_cell(allowed)} | {_cell(', '.join(flag.commands))} "
                   f"| {_cell(text)} |")
    return [*out, ""]


def render() -> str:
    from console.about import ENVIRONMENT
    from console.cli import build_parser
    from console.tui.args import build_parser as console_parser

    out = [HEADER, *launch_flags()]
    for parser in (*_commands(build_parser()), console_parser()):
        out += command_section(parser)
    out += ["## Environment", "", "```", ENVIRONMENT, "```", ""]
    return "\n".join(out)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
