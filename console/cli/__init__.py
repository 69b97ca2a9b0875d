"""`dsv4`: every console action as a scriptable command (`--json` wherever it lists).

Subcommand groups live in their own modules and register themselves; their handlers import
the runtime (and so torch) lazily, so `dsv4 --help` and the torch-free commands stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from store.errors import UserError

# Each module exposes `register(subparsers)`; order is the order of `dsv4 --help`.
GROUPS = (
    "console.cli.model",
    "console.cli.plan",
    "console.cli.purge",
    "console.cli.cache",
    "console.cli.keys",
    "console.cli.sidecar",
    "console.cli.serve",
    "console.cli.prepack",
    "console.cli.service",
    "console.cli.node",
    "console.cli.fleet",
    "console.cli.snapshot",
    "console.cli.bench",
)


def build_parser() -> argparse.ArgumentParser:
    from console.about import ENVIRONMENT, VersionAction, with_environment

    parser = argparse.ArgumentParser(
        prog="dsv4",
        description="DeepSeek V4 serving host tools: synthetic checkpoints, contract checks, "
        "kernel cache, weight sidecars, registration and serving, benchmarks. "
        "The operations console is `dsv4-console`. Tables are tab-separated when stdout is "
        "not a terminal.",
        epilog=ENVIRONMENT + "\n\nshell completion: eval \"$(dsv4 completion bash)\" (or zsh, tcsh)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in GROUPS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # a real import bug inside the module: surface it
                raise
            continue
        module.register(sub)
    completion = sub.add_parser("completion", help="print a shell completion script (bash, zsh, tcsh)",
                                description="Print the completion script for SHELL; e.g. "
                                "`eval \"$(dsv4 completion bash)\"` in ~/.bashrc.")
    completion.add_argument("shell", choices=("bash", "zsh", "tcsh"), help="the shell to complete for")
    completion.set_defaults(func=lambda args: _completion(parser, args.shell))
    with_environment(parser)
    return parser


def _completion(parser: argparse.ArgumentParser, shell: str) -> int:
    import shtab

    print(shtab.complete(parser, shell=shell))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except UserError as e:
        print(f"dsv4 {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:
        # `dsv4 … | head`: the reader left; say nothing more.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"dsv4 {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(code or 0)

