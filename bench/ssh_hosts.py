"""Hosts reached over SSH, on this one machine (as root): each a mount + UTS namespace with its own
hostname, its own files bound at one shared path (state, data, kernel cache, checkpoint), and a
real OpenSSH `sshd` (Debian's openssh-server) listening on a loopback address of its own
(127.0.0.2, …). Keys are made per run; the client's config lives in the caller's directory. The
fleet tests and `dsv4 bench console`'s fleet part both run on it.

A host can be given extra binds (another torch's version.py: a host with another toolchain),
refuse our key (authentication fails), or be killed whole: every process in its mount namespace,
as a host that loses power."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.ns_hosts import trust_each_other

VENV_BIN = Path(sys.executable).parent


@dataclass
class SshHost:
    name: str
    address: str
    port: int
    root: Path  # its own files, seen at `mount` inside its namespace
    mount: Path
    proc: subprocess.Popen | None = None
    binds: list[tuple[Path, Path]] = field(default_factory=list)

    def namespace(self) -> str | None:
        with contextlib.suppress(OSError):
            return os.readlink(f"/proc/{self.proc.pid}/ns/mnt") if self.proc else None
        return None

    def processes(self) -> list[int]:
        """Every process in this host's mount namespace (orphans of a detached node included)."""
        ns = self.namespace()
        if ns is None:
            return []
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.readlink(entry / "ns" / "mnt") == ns:
                        out.append(int(entry.name))
        return out

    def kill(self) -> None:
        """The host loses power: SIGKILL to every process in it, sshd included."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _wait_listening(host: SshHost, log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if host.proc is not None and host.proc.poll() is not None:
            raise AssertionError(f"sshd of {host.name} exited {host.proc.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection((host.address, host.port), timeout=1):
            return
        time.sleep(0.05)
    raise AssertionError(f"sshd of {host.name} did not listen on {host.address}:{host.port}")


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


@contextlib.contextmanager
def ssh_hosts(tmp: Path, names: list[str], sshd: str, *, model: Path | None = None, refuse: tuple[str, ...] = (),
              binds: dict[str, list[tuple[Path, Path]]] | None = None,
              trust: bool = False) -> Iterator[tuple[list[SshHost], Path]]:
    """Hosts `names` on 127.0.0.2, 127.0.0.3, …, each with its own copy of `model` at the shared
    path `tmp/host/model`; (the hosts, the client's ssh config). `refuse`: hosts whose sshd does
    not know our key; `sshd`: the server's path; `trust`: each host signs kernel-cache entries with a
    key of its own and trusts every host's. Every process of every host is killed on the way out."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    tmp.mkdir(parents=True, exist_ok=True)
    keys = tmp / "keys"
    keys.mkdir()
    _keygen(keys / "client")
    _keygen(keys / "host")
    (keys / "authorized_keys").write_text((keys / "client.pub").read_text())
    (keys / "nobody_keys").write_text("")
    mount = tmp / "host"
    mount.mkdir()
    hosts = []
    for i, name in enumerate(names):
        address = f"127.0.0.{2 + i}"
        root = tmp / f"root-{name}"
        for sub in ("state", "data", "programs"):
            (root / sub).mkdir(parents=True)
        if model is not None:
            shutil.copytree(model, root / "model")
        host = SshHost(name, address, _free_port(address), root, mount, binds=(binds or {}).get(name, []))
        env = {"DSV4_STATE_DIR": mount / "state", "DSV4_DATA_DIR": mount / "data",
               "DSV4_KERNEL_CACHE_DIR": mount / "programs", "DSV4_DEFAULT_PRESET": "tiny",
               "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin"}
        if trust:
            env.update(DSV4_SIGNING_KEY=mount / "keys" / "signing.key", DSV4_TRUSTED_KEYS=mount / "keys" / "trusted")
        if os.environ.get("PYTHONPATH"):  # the hosts run the very code under test (a worktree's, not the install's)
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        authorized = keys / ("nobody_keys" if name in refuse else "authorized_keys")
        (root / "sshd_config").write_text("\n".join([
            f"Port {host.port}", f"ListenAddress {address}", f"HostKey {keys / 'host'}",
            f"PidFile {root / 'sshd.pid'}", f"AuthorizedKeysFile {authorized}", "PermitRootLogin prohibit-password",
            "PasswordAuthentication no", "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no",
            "PrintMotd no", "LogLevel ERROR", "MaxStartups 100", "MaxSessions 100",
            "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()), ""]))
        extra = " && ".join(f'mount --bind "{src}" "{dst}"' for src, dst in host.binds)
        script = ('hostname "$1" && mount --bind "$2" "$3"' + (f" && {extra}" if extra else "")
                  + ' && exec "$4" -D -e -f "$5"')
        log = root / "sshd.log"
        with open(log, "w") as err:
            host.proc = subprocess.Popen(["unshare", "--mount", "--uts", "--fork", "sh", "-c", script, "sh", name,
                                          str(root), str(mount), sshd, str(root / "sshd_config")],
                                         stdout=subprocess.DEVNULL, stderr=err)
        hosts.append(host)
    if trust:
        trust_each_other(hosts)  # by name and root: as the rank test beds' hosts do

    config = tmp / "ssh_config"
    lines = ["Host *", f"  IdentityFile {keys / 'client'}", "  IdentitiesOnly yes",
             f"  UserKnownHostsFile {tmp / 'known_hosts'}", "  StrictHostKeyChecking accept-new", "  User root",
             "  LogLevel ERROR"]
    for h in hosts:
        lines += [f"Host {h.name}", f"  HostName {h.address}", f"  Port {h.port}"]
    config.write_text("\n".join(lines) + "\n")
    try:
        for h in hosts:
            _wait_listening(h, h.root / "sshd.log")
        yield hosts, config
    finally:
        for h in hosts:
            h.kill()


def fleet_file(path: Path, hosts: list[SshHost], config: Path, *, launch: dict | None = None,
               extra_hosts: list[str] = ()) -> Path:
    """A fleet file for `hosts` (and raw [[hosts]] tables in `extra_hosts`)."""
    lines = [f'ssh_config = "{config}"', ""]
    if launch:
        lines.append("[launch]")
        lines += [f"{k} = {v!r}".replace("'", '"') if isinstance(v, str) else f"{k} = {str(v).lower()}"
                  if isinstance(v, bool) else f"{k} = {v}" for k, v in launch.items()]
        lines.append("")
    for i, h in enumerate(hosts):
        lines += ["[[hosts]]", f'name = "{h.name}"', f"node_rank = {i}", ""]
    lines += list(extra_hosts)
    path.write_text("\n".join(lines) + "\n")
    return path


def other_torch(tmp: Path, version: str) -> tuple[Path, Path]:
    """A bind that makes a host's torch say it is `version` (its package's version.py, edited)."""
    import importlib.util

    real = Path(importlib.util.find_spec("torch").origin).parent / "version.py"
    fake = tmp / "torch-version.py"
    text, found = re.subn(r"^__version__\b.*$", f"__version__ = '{version}'", real.read_text(), count=1,
                          flags=re.MULTILINE)
    assert found, f"no __version__ line in {real}"
    fake.write_text(text)
    return fake, real
