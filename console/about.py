"""What both commands say about themselves (`--version`, the environment in `--help`);
imports nothing heavy, so `dsv4 --help` stays fast."""

from __future__ import annotations

ENVIRONMENT = """environment:
  DSV4_KERNEL_CACHE_DIR  program cache root (default <user cache dir>/dsv4-console/programs)
  DSV4_DATA_DIR          where the embedded default checkpoint lives (<user data dir>/dsv4-console)
  DSV4_DEFAULT_PRESET    preset of the embedded default checkpoint (tiny|small|medium; default small)
  DSV4_STATE_DIR         launch history, service registry and detached service logs
                         (default <user state dir>/dsv4-console)
  NO_COLOR               no colours"""


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("dsv4-console")
    except PackageNotFoundError:
        return "unknown"
