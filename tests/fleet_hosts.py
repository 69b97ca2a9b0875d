"""The fleet tests' hosts (`bench.ssh_hosts`), with Debian's openssh-server made present first."""

from __future__ import annotations

import contextlib
from pathlib import Path

from servers import ensure_binary

from bench.ssh_hosts import fleet_file, other_torch  # noqa: F401 - what the tests use
from bench.ssh_hosts import ssh_hosts as _ssh_hosts


@contextlib.contextmanager
def ssh_hosts(tmp: Path, names: list[str], **kw):
    with _ssh_hosts(tmp, names, ensure_binary("sshd", "openssh-server"), **kw) as bed:
        yield bed
