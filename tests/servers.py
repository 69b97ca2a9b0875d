"""Real servers for tests, started and stopped by the tests themselves: a Debian package's
binary made present (`ensure_binary`), and the CNCF distribution registry (Debian's
`docker-registry`, `bench.registry_server`) on a free loopback port, storage in a temp dir."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.registry_server import Registry, serve


def _which(binary: str) -> str | None:
    # sbin is often not on a test's PATH (sshd lives there)
    return shutil.which(binary) or next(
        (str(p) for d in ("/usr/sbin", "/usr/bin", "/sbin") if os.access(p := Path(d) / binary, os.X_OK)), None)


def ensure_binary(binary: str, package: str) -> str:
    """The path of `binary`; when missing and we are root, `apt-get install` its Debian `package`
    first (after `apt-get update` if the install fails); when missing otherwise, skip the test."""
    if found := _which(binary):
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip(f"{binary} is not installed (Debian package {package}) and this user cannot install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", package]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=False)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.fail(f"apt-get install {package} failed: {done.stderr.strip()[-500:]}")
    if found := _which(binary):
        return found
    pytest.fail(f"{package} installed but {binary} is not found")


@contextlib.contextmanager
def registry(work: Path, host: str = "127.0.0.1") -> Iterator[Registry]:
    """A running registry (bench.registry_server.Registry) until the block ends."""
    with serve(ensure_binary("docker-registry", "docker-registry"), work, host) as reg:
        yield reg
