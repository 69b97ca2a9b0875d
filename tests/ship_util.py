"""Shared pieces of the tests of entries that travel: the `dsv4` CLI run as operators run it,
key pairs, a bundle exported from the warm export-backend cache, a cache root's listing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import MAX_SEQ

LAUNCH = ("--backend", "export", "--device", "cpu", "--max-seq", str(MAX_SEQ))


def dsv4(*args, env: dict | None = None, **run) -> subprocess.CompletedProcess:
    """`dsv4 ARGS` in a subprocess (no trusted or signing keys from the environment); `run`:
    more arguments of subprocess.run (a preexec_fn)."""
    base = {k: v for k, v in os.environ.items() if k not in ("DSV4_SIGNING_KEY", "DSV4_TRUSTED_KEYS")}
    return subprocess.run([sys.executable, "-m", "console.cli", *map(str, args)], capture_output=True, text=True,
                          env={**base, **(env or {})}, timeout=600, **run)


def make_keys(where: Path, name: str) -> tuple[Path, Path]:
    """(private key file, trusted-keys file holding its public line)."""
    key = where / f"{name}.key"
    done = dsv4("keys", "generate", "--out", key, "--name", name)
    assert done.returncode == 0, done.stderr
    return key, key.with_name(key.name + ".pub")


def export(model: Path, cache_dir: Path, out: Path, key: Path, *extra) -> subprocess.CompletedProcess:
    return dsv4("cache", "export", "-o", out, "--model", model, *LAUNCH, "--kernel-cache-dir", cache_dir,
                "--signing-key", key, *extra)


def import_(bundle: Path, model: Path, cache_dir: Path, trusted: Path | None, *extra,
            **run) -> subprocess.CompletedProcess:
    trust = ("--trusted-keys", trusted) if trusted else ()
    return dsv4("cache", "import", bundle, "--model", model, *LAUNCH, "--kernel-cache-dir", cache_dir, *trust,
                *extra, **run)


def plan_states(model: Path, cache_dir: Path, *launch) -> dict[str, str]:
    done = dsv4("plan", model, *(launch or LAUNCH), "--kernel-cache-dir", cache_dir, "--json", "--no-sidecar")
    assert done.stdout, done.stderr
    return {p["program"]: p["state"] for p in json.loads(done.stdout)["programs"]}


def listing(root: Path) -> list[tuple[str, int]]:
    """Every path under `root` with its size (what 'the cache as before' compares)."""
    if not root.exists():
        return []
    out = []
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            out.append((str(p.relative_to(root)), p.lstat().st_size if p.is_file() else -1))
    return sorted(out)


def one_line_refusal(done: subprocess.CompletedProcess, *words: str) -> str:
    """Assert `done` failed with exit 1 and one line on stderr holding every word; the line."""
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def a_program(cache_dir: Path) -> str:
    """The name of one program cached under `cache_dir`."""
    return sorted(p.name for p in (Path(cache_dir) / "v1").iterdir() if not p.name.startswith("."))[0]
