"""A live `dsv4 serve` behind its door (one service for the concern): HTTPS with a CA made for
this run, an API key from a private file (never on its command line), the console reading it with
--api-key-file/--ca-file and saying in one line what it lacks; and the settings that cannot serve
refused in one line before registration."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import start_server
from door_fakes import key_file, make_pki

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
KEY = "e2e-" + "z" * 36


def _dsv4(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "console.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def _console_once(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "console.tui.app", "--once", "--json", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout)["services"]["services"]


def test_https_and_a_key_serve_and_the_console_reads_them(tiny_ckpt_ro, tmp_path):
    pki = make_pki(tmp_path / "pki")
    keys = key_file(tmp_path / "keys", console=KEY, gateway="g" * 32)
    proc, url, _ = start_server(tiny_ckpt_ro, tmp_path, "--backend", "eager", "--validate-tokens", "1",
                                "--api-key-file", str(keys), "--ssl-certfile", str(pki.cert), "--ssl-keyfile",
                                str(pki.key))
    try:
        assert url.startswith("https://127.0.0.1:")
        assert KEY not in " ".join(psutil.Process(proc.pid).cmdline())  # only the file's path is
        verify = {"verify": ssl.create_default_context(cafile=str(pki.ca)), "timeout": 120}
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 3},
                        headers={"Authorization": f"Bearer {'g' * 32}"}, **verify)
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 3
        bare = httpx.get(f"{url}/health", **verify)
        assert bare.status_code == 401 and bare.headers["www-authenticate"] == 'Bearer realm="dsv4"'
        common = ["--model", str(tiny_ckpt_ro), "--device", "cpu", "--kernel-cache-dir", str(tmp_path / "programs")]
        [seen] = _console_once(*common, "--api-key-file", str(keys), "--ca-file", str(pki.ca))
        assert seen["state"] == "serving" and seen["detail"]["free_slots"] == seen["detail"]["slots"]
        [refused] = _console_once(*common, "--ca-file", str(pki.ca))
        assert refused["health"] == "HTTP 401" and refused["problem"].startswith("401: the service needs an API key")
        [unverified] = _console_once(*common, "--api-key-file", str(keys))
        assert "its TLS certificate cannot be verified" in unverified["problem"]
        metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, **verify).text
        assert 'dsv4_api_key_requests_total{key="console",result="accepted"}' in metrics and KEY not in metrics
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.parametrize("problem", ["world-readable keys", "no such key file", "a key on its own", "tls key public",
                                     "certificate without key"])
def test_a_door_that_cannot_serve_is_one_line_before_registration(tiny_ckpt_ro, tmp_path, problem):
    pki = make_pki(tmp_path / "pki")
    keys = key_file(tmp_path / "keys", a=KEY)
    flags = {"world-readable keys": ["--api-key-file", str(key_file(tmp_path / "open", 0o644, a=KEY))],
             "no such key file": ["--api-key-file", str(tmp_path / "missing")],
             "a key on its own": ["--api-key-file", str(_raw(tmp_path / "bare", KEY))],
             "tls key public": ["--api-key-file", str(keys), "--ssl-certfile", str(pki.cert), "--ssl-keyfile",
                                str(_public(pki.key, tmp_path / "tls.key"))],
             "certificate without key": ["--ssl-certfile", str(pki.cert)]}[problem]
    events = tmp_path / "events.jsonl"
    r = _dsv4("serve", str(tiny_ckpt_ro), "--device", "cpu", "--backend", "eager", "--port", "0", "--events",
              str(events), *flags)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and r.stderr.startswith("dsv4 serve: "), r.stderr
    assert KEY not in r.stderr
    assert not events.exists() or "programs" not in events.read_text()  # nothing registered


def _raw(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def _public(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    os.chmod(dst, 0o644)
    return dst
