"""Every flag says what it does, and every command's --help lists the environment it reads."""

from __future__ import annotations

import argparse

from console.cli import build_parser
from console.tui.args import build_parser as console_parser


def _commands(parser: argparse.ArgumentParser, prefix: str = "dsv4"):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{prefix} {name}")


def test_every_flag_has_a_description_and_every_command_lists_its_environment():
    missing, no_env = [], []
    for name, parser in [*_commands(build_parser()), ("dsv4-console", console_parser())]:
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            if action.help is None:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
        has_subcommands = any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
        if not has_subcommands and "environment:" not in (parser.epilog or ""):
            no_env.append(name)
    assert missing == [] and no_env == []
