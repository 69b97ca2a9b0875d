"""What both commands say about themselves (`--version`, the environment in `--help`);
imports nothing heavy, so `dsv4 --help` stays fast."""

from __future__ import annotations

import argparse
import sys

ENVIRONMENT = """environment:
  DSV4_KERNEL_CACHE_DIR  kernel cache root (default <user cache dir>/dsv4-console/programs)
  DSV4_KERNEL_CACHE_MAX_SIZE
                         the kernel cache's size limit: `dsv4 cache gc` evicts down to it, the
                         console shows the disk used against it (default 10G)
  DSV4_SIGNING_KEY       the private key entries are signed with, readable by its owner only:
                         by `dsv4 cache export|push`, and by `dsv4 serve` (and the console's
                         launches) for the programs a host compiles for the others of a service
                         across hosts (default <user config dir>/dsv4-console/signing.key;
                         --signing-key FILE instead)
  DSV4_TRUSTED_KEYS      the public keys whose signed entries are installed, one `NAME KEY ID`
                         line each (`dsv4 keys show`): by `dsv4 cache import|pull`, and by
                         `dsv4 serve` (and the console's launches) across hosts instead of
                         compiling (--trusted-keys FILE instead); unset: nothing from another
                         host is installed, each host compiles for itself
  DSV4_API_KEY_FILE      API keys, one `NAME KEY` a line, private to you: `dsv4 serve` (and the
                         console's launches) then wants `Authorization: Bearer KEY` on every
                         request; the console and fleet send its first key (--api-key-file FILE
                         instead; docs/security.md)
  DSV4_CA_FILE           the CA certificates that vouch for the services' HTTPS certificates,
                         for the console and fleet (--ca-file FILE instead; default the system's)
  DOCKER_CONFIG          where `dsv4 cache push|pull` read registry credentials (config.json, as
                         `docker login` writes them; default ~/.docker)
  DSV4_DATA_DIR          where the embedded default checkpoint lives (<user data dir>/dsv4-console)
  DSV4_DEFAULT_PRESET    preset of the embedded default checkpoint (tiny|small|medium; default small)
  DSV4_STATE_DIR         launch history, service registry and detached service logs
                         (default <user state dir>/dsv4-console)
  NO_COLOR               no colours"""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's own wrapping, except for the environment table, which keeps its columns."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("environment:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def with_environment(parser: argparse.ArgumentParser) -> None:
    """Every command's --help ends with the environment it reads (ENVIRONMENT), once."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                with_environment(sub)
    if ENVIRONMENT in (parser.epilog or ""):
        return
    parser.epilog = f"{parser.epilog}\n\n{ENVIRONMENT}" if parser.epilog else ENVIRONMENT
    if parser.formatter_class is argparse.HelpFormatter:
        parser.formatter_class = HelpFormatter


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("dsv4-console")
    except PackageNotFoundError:
        return "unknown"


class VersionAction(argparse.Action):
    """`--version`, reading the installed version only when asked (importlib.metadata costs
    ~0.1 s at every start otherwise)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help or "show the version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {version()}", file=sys.stdout)
        parser.exit()
