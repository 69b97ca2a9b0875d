"""Hosts on this one machine, for a service across hosts (its tests and `dsv4 bench hosts`): a
host is a mount + UTS namespace (`unshare --mount --uts`, as root) with its own hostname and its
own directory bound at one shared path, so every host sees "its" checkpoint, kernel cache, state
and keys at the same paths, as hosts with their own disks do. Its ranks are `dsv4 serve`
processes, started either with the torchrun variables set by hand (RANK, WORLD_SIZE,
MASTER_ADDR/PORT) or by a real torchrun agent per host (`python -m runtime.launch.torchrun --nnodes H
--node-rank K`: torchrun, its store listening on the master address alone), on loopback."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_SEQ = 64  # small fixed-size KV caches keep every launch on the test bed cheap
KEY_VARS = ("DSV4_SIGNING_KEY", "DSV4_TRUSTED_KEYS")


def namespaces_work() -> str | None:
    """None when this process may give a rank its own mount and UTS namespace; else why not."""
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    probe = subprocess.run(["unshare", "--mount", "--uts", "--fork", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"unshare --mount --uts fails here: {probe.stderr.strip()}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Host:
    """One host: `root` (its own files) is what it sees at `mount`; `name` its hostname (None:
    this machine itself, no namespace — the same layout, one host)."""

    name: str | None
    root: Path
    mount: Path
    keys_by_flag: bool = False  # its keys named by --signing-key / --trusted-keys, not by the environment

    @property
    def model(self) -> Path:
        return self.mount / "model" if self.name else self.root / "model"

    @property
    def label(self) -> str:
        return self.name or "local"

    def keys(self) -> dict[str, str]:
        """Its signing key and (when it has the file) trusted keys, at the shared path: variable → file."""
        here = self.mount if self.name else self.root
        return {"DSV4_SIGNING_KEY": str(here / "keys" / "signing.key"),
                **({"DSV4_TRUSTED_KEYS": str(here / "keys" / "trusted")} if (self.root / "keys" / "trusted").exists()
                   else {})}

    def env(self) -> dict[str, str]:
        """Its user dirs and keys, at the shared path (where the bind puts its own)."""
        here = self.mount if self.name else self.root
        return {"DSV4_STATE_DIR": str(here / "state"), "DSV4_DATA_DIR": str(here / "data"),
                "DSV4_KERNEL_CACHE_DIR": str(here / "programs"), **({} if self.keys_by_flag else self.keys())}

    def key_flags(self) -> list[str]:
        flags = {"DSV4_SIGNING_KEY": "--signing-key", "DSV4_TRUSTED_KEYS": "--trusted-keys"}
        return [x for var, path in self.keys().items() for x in (flags[var], path)] if self.keys_by_flag else []

    def serve(self, events: Path, *args: str, backend: str = "eager", max_seq: int = MAX_SEQ) -> list[str]:
        """`serve MODEL …` (after `-m console.cli`) for this host's checkpoint, events to `events`."""
        return ["serve", str(self.model), "--device", "cpu", "--backend", backend, "--port", "0", "--max-seq",
                str(max_seq), "--rendezvous-timeout", "300", "--events", str(events), *self.key_flags(), *args]

    def inside(self, argv: list[str]) -> list[str]:
        """`argv` run inside this host: its hostname, its own files bound at the shared path."""
        if not self.name:
            return argv
        script = 'hostname "$1" && mount --bind "$2" "$3" && shift 3 && exec "$@"'
        return ["unshare", "--mount", "--uts", "--fork", "sh", "-c", script, "sh", self.name, str(self.root),
                str(self.mount), *argv]

    def _start(self, argv: list[str], extra_env: dict[str, str], log: Path) -> subprocess.Popen:
        env = {**{k: v for k, v in os.environ.items() if k not in KEY_VARS}, **self.env(), **extra_env,
               "PYTHONPATH": str(REPO)}
        with open(log, "w") as err:
            return subprocess.Popen(self.inside(argv), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                    text=True, start_new_session=True)

    def rank(self, rank: int, world: int, port: int, out: Path, *args: str, backend: str = "eager",
             max_seq: int = MAX_SEQ) -> subprocess.Popen:
        """Rank `rank` of `world` serving this host's checkpoint, started with the torchrun
        variables set by hand; its events and stderr in `out`."""
        argv = [sys.executable, "-m", "console.cli",
                *self.serve(out / f"events-{rank}.jsonl", *args, backend=backend, max_seq=max_seq)]
        ranks = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        return self._start(argv, ranks, out / f"stderr-{rank}.log")

    def node(self, node_rank: int, nodes: int, ranks: int, port: int, out: Path, *args: str, backend: str = "eager",
             max_seq: int = MAX_SEQ) -> subprocess.Popen:
        """This host as node `node_rank` of `nodes` under a real torchrun agent running `ranks`
        rank processes here (node 0's agent hosts the store on `port`); its ranks' events in
        `out/events-<host>.jsonl`, the agent's and the ranks' stderr in `out/stderr-<host>.log`."""
        argv = [sys.executable, "-m", "runtime.launch.torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(ranks),
                "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "-m", "console.cli",
                *self.serve(out / f"events-{self.label}.jsonl", *args, backend=backend, max_seq=max_seq)]
        return self._start(argv, {}, out / f"stderr-{self.label}.log")


def hosts(tmp_path: Path, model: Path, names: list[str | None]) -> list[Host]:
    """One host per name, each with its own copy of `model` (other mtimes: copied, not linked)."""
    mount = tmp_path / "host"
    mount.mkdir(parents=True, exist_ok=True)
    out = []
    for i, name in enumerate(names):
        root = tmp_path / f"root-{name or i}"
        shutil.copytree(model, root / "model")
        for p in (root / "model").iterdir():
            os.utime(p, (1_000_000 + i, 1_000_000 + i))  # other mtimes: what a copy on another host has
        out.append(Host(name, root, mount))
    return out


def trust_each_other(hosts: list[Host]) -> None:
    """Every host gets a signing key and trusts every host's public key (its own included)."""
    from store.signing import SigningKey

    keys = []
    for h in hosts:
        key = SigningKey.generate(h.name or "local")
        (h.root / "keys").mkdir(parents=True, exist_ok=True)
        fd = os.open(h.root / "keys" / "signing.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.line() + "\n")
        keys.append(key.public.line())
    for h in hosts:
        (h.root / "keys" / "trusted").write_text("\n".join(keys) + "\n")


def stop(procs: list[subprocess.Popen]) -> None:
    """Each process and everything under it (unshare keeps its child through SIGTERM, a torchrun
    agent its ranks, each in a session of its own): SIGTERM, then SIGKILL for what is left."""
    import psutil

    tree: list = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            tree += psutil.Process(proc.pid).children(recursive=True)
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=30)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
