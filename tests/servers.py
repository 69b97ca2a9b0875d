"""Real servers for tests, started and stopped by the tests themselves: a Debian package's
binary made present (`ensure_binary`), and the CNCF distribution registry (Debian's
`docker-registry`) on a free loopback port with filesystem storage in a temp dir."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


def ensure_binary(binary: str, package: str) -> str:
    """The path of `binary`; when missing and we are root, `apt-get install` its Debian `package`
    first (after `apt-get update` if the install fails); when missing otherwise, skip the test."""
    found = shutil.which(binary) or next(
        (str(p) for p in (Path("/usr/sbin") / binary, Path("/usr/bin") / binary) if os.access(p, os.X_OK)), None)
    if found:
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
    found = shutil.which(binary) or next(
        (str(p) for p in (Path("/usr/sbin") / binary, Path("/usr/bin") / binary) if os.access(p, os.X_OK)), None)
    if not found:
        pytest.fail(f"{package} installed but {binary} is not on PATH")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a server we started, by its pid: terminate, then kill."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)


@dataclass
class Registry:
    """A running distribution registry: `address` (host:port, plain HTTP), its storage dir."""

    address: str
    storage: Path
    proc: subprocess.Popen

    def blob_file(self, digest: str) -> Path:
        """Where the registry keeps a blob on disk (to change it under the registry's feet)."""
        hexd = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"

    def stop(self) -> None:
        stop(self.proc)


@contextlib.contextmanager
def registry(tmp: Path, host: str = "127.0.0.1") -> Iterator[Registry]:
    """`docker-registry serve CONFIG` on a free port of `host` until the block ends."""
    binary = ensure_binary("docker-registry", "docker-registry")
    port = free_port(host)
    storage = tmp / "storage"
    storage.mkdir(parents=True)
    config = tmp / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: {host}:{port}\n")
    log = open(tmp / "registry.log", "w")  # noqa: SIM115 - closed at the end of the block
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 30
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"registry exited {proc.returncode}: {(tmp / 'registry.log').read_text()}")
            try:
                with urllib.request.urlopen(f"http://{host}:{port}/v2/", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                if time.time() > deadline:
                    raise AssertionError("registry did not answer /v2/ within 30 s") from None
                time.sleep(0.1)
        yield Registry(f"{host}:{port}", storage, proc)
    finally:
        stop(proc)
        log.close()
