"""A CNCF distribution registry (Debian's `docker-registry`) on a loopback port, filesystem
storage under a directory of the caller: what the tests (tests/servers.py) and
`dsv4 bench cache-ship` push to and pull from."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


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
    """A running registry: `address` (host:port, plain HTTP), its storage dir, its process."""

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
def serve(binary: str, work: Path, host: str = "127.0.0.1") -> Iterator[Registry]:
    """`docker-registry serve CONFIG` on a free port of `host` until the block ends; `work`
    holds its config, storage and log."""
    port = free_port(host)
    storage = work / "storage"
    storage.mkdir(parents=True)
    config = work / "config.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: {host}:{port}\n")
    log_path = work / "registry.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 30
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"registry exited {proc.returncode}: {log_path.read_text()[-2000:]}")
                try:
                    with urllib.request.urlopen(f"http://{host}:{port}/v2/", timeout=2):
                        break
                except (urllib.error.URLError, OSError):
                    if time.time() > deadline:
                        raise RuntimeError("registry did not answer /v2/ within 30 s") from None
                    time.sleep(0.1)
            yield Registry(f"{host}:{port}", storage, proc)
        finally:
            stop(proc)
