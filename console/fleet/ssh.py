"""The system `ssh`, as the fleet runs it on each host: batch mode (never a password prompt), the
operator's own config and agent, and connection sharing (ControlMaster) so that a refresh or an
action does not pay a handshake; what its failures mean, in one line.

Options given by the operator come first on the command line (ssh takes the first value it is
given for an option), so a host's `ssh_options`, then the fleet's, then `--ssh-option`, override
the defaults here."""

from __future__ import annotations

import contextlib
import os
import shlex
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from console.fleet.spec import FleetHost

CONNECT_TIMEOUT_S = 5
PERSIST_S = 60  # a master connection outlives its last session this long
MISSING = 127  # what a POSIX shell answers for a command it cannot find


def control_dir() -> Path:
    """A directory only this user can enter, with a short path (a socket path has 108 bytes):
    $XDG_RUNTIME_DIR/dsv4-ssh, else /tmp/dsv4-ssh-UID, else a fresh private temporary one (a
    path someone else made, or a link, is never used)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    for path in ([Path(base) / "dsv4-ssh"] if base else []) + [Path(tempfile.gettempdir()) / f"dsv4-ssh-{os.getuid()}"]:
        with contextlib.suppress(OSError):
            path.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077:
                return path
    return Path(tempfile.mkdtemp(prefix="dsv4-ssh-"))


@dataclass(frozen=True)
class Ssh:
    config: str | None = None  # `ssh -F`
    options: tuple[str, ...] = ()  # `ssh -o`, for every host
    control: Path | None = None  # ControlPath's directory (None: no connection sharing)
    connect_timeout: int = CONNECT_TIMEOUT_S

    def base(self, host: FleetHost) -> list[str]:
        """`ssh` and its options for `host`, up to the destination."""
        argv = ["ssh", "-T", "-x"]
        if self.config:
            argv += ["-F", self.config]
        ours = ["BatchMode=yes", f"ConnectTimeout={self.connect_timeout}", "ServerAliveInterval=5",
                "ServerAliveCountMax=3"]
        if self.control is not None:
            ours += ["ControlMaster=auto", f"ControlPath={self.control}/%C", f"ControlPersist={PERSIST_S}"]
        for option in (*host.ssh_options, *self.options, *ours):
            argv += ["-o", option]
        if host.user:
            argv += ["-l", host.user]
        if host.port:
            argv += ["-p", str(host.port)]
        return argv

    def argv(self, host: FleetHost, *remote: str) -> list[str]:
        """`remote` (a dsv4 command line: its first word the host's dsv4) run on `host`."""
        return [*self.base(host), "--", host.destination, shlex.join([host.dsv4, *remote])]

    def close(self, host: FleetHost) -> None:
        """End the shared connection to `host` (the console is leaving)."""
        if self.control is None:
            return
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([*self.base(host), "-O", "exit", "--", host.destination], capture_output=True,
                           timeout=5, stdin=subprocess.DEVNULL)


def why(host: FleetHost, code: int | None, stderr: list[str]) -> str:
    """What an ssh run that failed means, in one line: authentication, a timeout, a refused or
    unknown host, `dsv4` missing there, or the remote command's own last words."""
    text = "\n".join(stderr)
    last = next((line.strip() for line in reversed(stderr) if line.strip()), "")
    if code == 255 or text.startswith("ssh:") or "ssh_exchange" in text:
        lowered = text.lower()
        for needle, said in (("permission denied", "authentication failed"),
                             ("host key verification failed", "host key verification failed"),
                             ("timed out", "timeout"), ("connection refused", "connection refused"),
                             ("could not resolve hostname", "unknown host"), ("no route to host", "no route to host"),
                             ("connection closed", "connection closed"), ("broken pipe", "connection lost")):
            if needle in lowered:
                return f"{said} ({last})" if last and said not in last.lower() else said
        return f"ssh failed ({last or f'exit {code}'})"
    if code == MISSING or "command not found" in text or (host.dsv4 in text and "No such file" in text):
        return (f"dsv4 missing: `{host.dsv4}` is not on that host's PATH (give its path as `dsv4 = …` for "
                f"this host in the fleet file)")
    return f"{host.dsv4} exited {code}: {last}" if last else f"{host.dsv4} exited {code}"
