"""Kernel-cache entries through a real OCI registry (Debian's docker-registry, the CNCF
distribution server, started here on 127.0.0.1): push, pull exactly what a launch misses, and the
hostile registry cases — each one line, nothing installed (issue 34)."""

from __future__ import annotations

import contextlib
import http.server
import json
import shutil
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import ClassVar

import pytest
from servers import registry
from ship_util import LAUNCH, dsv4, listing, make_keys, one_line_refusal, plan_states

from store.fingerprint import fingerprint
from store.kernel_cache import oci
from store.registry import Client, Repository

REPO = "dsv4/programs"


@pytest.fixture(scope="module")
def pushed(tmp_path_factory, cold_export_launch, tiny_ckpt_ro):
    """A registry holding the tiny launch's entries, pushed by `builder`."""
    where = tmp_path_factory.mktemp("registry")
    key, trusted = make_keys(where, "builder")
    with registry(where / "srv") as reg:
        done = dsv4("cache", "push", f"{reg.address}/{REPO}", "--model", tiny_ckpt_ro, *LAUNCH,
                    "--kernel-cache-dir", cold_export_launch[0], "--signing-key", key, "--insecure")
        assert done.returncode == 0, done.stderr
        yield reg, key, trusted


def pull(target: str, model, dst, trusted, *extra):
    return dsv4("cache", "pull", target, "--model", model, *LAUNCH, "--kernel-cache-dir", dst, "--trusted-keys",
                trusted, *extra)


def test_push_then_pull_into_an_empty_cache_makes_the_launch_hit(pushed, tiny_ckpt_ro, tmp_path):
    reg, _, trusted = pushed
    dst = tmp_path / "fresh"
    done = pull(f"{reg.address}/{REPO}", tiny_ckpt_ro, dst, trusted, "--insecure")
    assert done.returncode == 0, done.stderr
    states = plan_states(tiny_ckpt_ro, dst)
    assert states and set(states.values()) == {"HIT"}
    entries = json.loads(dsv4("cache", "ls", "--json", "--kernel-cache-dir", dst).stdout)
    assert all(e["origin"]["reference"].startswith(f"{reg.address}/{REPO}@sha256:") for e in entries)
    again = pull(f"{reg.address}/{REPO}", tiny_ckpt_ro, dst, trusted, "--insecure")
    assert again.returncode == 0 and "misses no program" in again.stdout


def test_the_artifact_layout_in_the_registry(pushed, cold_export_launch):
    reg, _, _ = pushed
    program = sorted(p.name for p in (cold_export_launch[0] / "v1").iterdir() if not p.name.startswith("."))[0]
    fp = next(p.name for p in (cold_export_launch[0] / "v1" / program).iterdir() if not p.name.startswith("."))
    client = Client(Repository.parse(f"{reg.address}/{REPO}", insecure=True))
    body, _ = client.get_manifest(fp)
    doc = json.loads(body)
    assert doc["artifactType"] == oci.ARTIFACT_TYPE and doc["config"]["digest"] == f"sha256:{fp}"
    assert doc["annotations"][oci.A_PROGRAM] == program and doc["annotations"][oci.A_BACKEND] == "export"
    assert "torch" in doc["annotations"][oci.A_TOOLCHAIN] and oci.A_SIGNATURE in doc["annotations"]
    assert doc["layers"][0]["annotations"][oci.TITLE] == "manifest.json"


def test_plain_http_only_with_insecure(pushed, tiny_ckpt_ro, tmp_path):
    reg, _, trusted = pushed
    dst = tmp_path / "fresh"
    one_line_refusal(pull(f"{reg.address}/{REPO}", tiny_ckpt_ro, dst, trusted), reg.address)
    one_line_refusal(pull(f"http://{reg.address}/{REPO}", tiny_ckpt_ro, dst, trusted, "--insecure"),
                     "without a scheme")
    assert not dst.exists()


def test_a_blob_changed_in_the_registrys_own_storage(tmp_path, cold_export_launch, tiny_ckpt_ro):
    key, trusted = make_keys(tmp_path, "builder")
    with registry(tmp_path / "srv") as reg:
        target = f"{reg.address}/{REPO}"
        assert dsv4("cache", "push", target, "--model", tiny_ckpt_ro, *LAUNCH, "--kernel-cache-dir",
                    cold_export_launch[0], "--signing-key", key, "--insecure").returncode == 0
        client = Client(Repository.parse(target, insecure=True))
        program = sorted(p.name for p in (cold_export_launch[0] / "v1").iterdir() if not p.name.startswith("."))[0]
        fp = next(p.name for p in (cold_export_launch[0] / "v1" / program).iterdir() if not p.name.startswith("."))
        layer = json.loads(client.get_manifest(fp)[0])["layers"][1]
        blob = reg.blob_file(layer["digest"])
        data = bytearray(blob.read_bytes())
        data[-1] ^= 0xFF  # same size: only a re-hash sees it
        blob.write_bytes(bytes(data))
        dst = tmp_path / "fresh"
        one_line_refusal(pull(target, tiny_ckpt_ro, dst, trusted, "--insecure"), "does not match its digest")
        assert listing(dst) == []


def test_a_layer_far_larger_than_its_manifest_says(pushed, tiny_ckpt_ro, tmp_path, cold_export_launch):
    reg, _, trusted = pushed
    target = f"{reg.address}/{REPO}-big"
    client = Client(Repository.parse(target, insecure=True))
    # copy one pushed artifact into another repository, its artifact layer swapped for a huge one
    src = Client(Repository.parse(f"{reg.address}/{REPO}", insecure=True))
    program = sorted(p.name for p in (cold_export_launch[0] / "v1").iterdir() if not p.name.startswith("."))[0]
    fp = next(p.name for p in (cold_export_launch[0] / "v1" / program).iterdir() if not p.name.startswith("."))
    doc = json.loads(src.get_manifest(fp)[0])
    for d in [doc["config"], *doc["layers"]]:
        client.put_blob(src.get_blob(d["digest"], d["size"]))
    huge = b"\0" * (16 << 20)
    doc["layers"][1].update(digest=client.put_blob(huge), size=len(huge))
    client.put_manifest(fp, json.dumps(doc).encode())
    dst = tmp_path / "fresh"
    one_line_refusal(pull(target, tiny_ckpt_ro, dst, trusted, "--insecure"), "its manifest says")
    assert listing(dst) == []


class _Proxy(http.server.BaseHTTPRequestHandler):
    """Forwards GETs to the registry and records their paths (`seen`); `on_blob(handler, n)` may
    answer the n-th blob request itself (returning True) instead of forwarding it."""

    upstream = ""
    seen: ClassVar[list[str]] = []
    on_blob = staticmethod(lambda handler, n: False)

    def do_GET(self):
        seen = type(self).seen
        seen.append(self.path)
        if "/blobs/" in self.path and type(self).on_blob(self, sum("/blobs/" in p for p in seen)):
            return
        status, body = self.upstream_answer()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def upstream_answer(self) -> tuple[int, bytes]:
        """The registry's status and body for this request (its headers are sent here)."""
        try:
            with urllib.request.urlopen(urllib.request.Request(
                    f"http://{self.upstream}{self.path}", headers={"Accept": self.headers.get("Accept", "")})) as r:
                self._headers = {k: r.headers[k] for k in ("Content-Type", "Docker-Content-Digest") if r.headers.get(k)}
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            self._headers = {}
            return e.code, e.read()

    def send_response(self, code, message=None):
        super().send_response(code, message)
        for k, v in getattr(self, "_headers", {}).items():
            self.send_header(k, v)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def proxy(reg, on_blob=lambda handler, n: False):
    """A `_Proxy` in front of `reg` until the block ends: (its REGISTRY/REPO, the paths it was asked)."""
    seen: ClassVar[list[str]] = []
    handler = type("Proxy", (_Proxy,), {"upstream": reg.address, "seen": seen, "on_blob": staticmethod(on_blob)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}/{REPO}", seen
    finally:
        server.shutdown()
        server.server_close()


def blobs(seen: list[str]) -> list[str]:
    return [p for p in seen if "/blobs/" in p]


def one_entry_cache(src: Path, dst: Path) -> Path:
    """A copy of the cache `src` holding one of its entries only (so 'as before' is not 'empty')."""
    shutil.copytree(src, dst, symlinks=True)
    for program in sorted(p for p in (dst / "v1").iterdir() if not p.name.startswith("."))[1:]:
        shutil.rmtree(program)
    return dst


def test_the_registry_stopping_mid_pull(tmp_path, cold_export_launch, tiny_ckpt_ro):
    key, trusted = make_keys(tmp_path, "builder")
    with registry(tmp_path / "srv") as reg:
        assert dsv4("cache", "push", f"{reg.address}/{REPO}", "--model", tiny_ckpt_ro, *LAUNCH,
                    "--kernel-cache-dir", cold_export_launch[0], "--signing-key", key, "--insecure").returncode == 0

        def stop(handler, n):  # the registry is gone: the connection drops without an answer
            reg.stop()
            handler.close_connection = True
            return True

        with proxy(reg, stop) as (target, _):
            dst = tmp_path / "fresh"
            line = one_line_refusal(pull(target, tiny_ckpt_ro, dst, trusted, "--insecure"), "/blobs/")
            assert reg.proc.poll() is not None, "the registry was stopped mid-pull"
            assert listing(dst) == [], line


def test_a_blob_cut_part_way(pushed, cold_export_launch, tiny_ckpt_ro, tmp_path):
    """The registry sends an artifact's headers and half its body, then the connection closes."""
    reg, _, trusted = pushed
    sent = []

    def cut(handler, n):
        if n != 2:  # blob 1: the first entry's manifest; blob 2: its first artifact
            return False
        status, body = handler.upstream_answer()
        assert status == 200 and len(body) > 1
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body[: len(body) // 2])
        handler.wfile.flush()
        handler.close_connection = True
        sent.append((len(body) // 2, len(body)))
        return True

    dst = one_entry_cache(cold_export_launch[0], tmp_path / "dst")
    before = listing(dst)
    with proxy(reg, cut) as (target, _):
        line = one_line_refusal(pull(target, tiny_ckpt_ro, dst, trusted, "--insecure"), "blob sha256:")
    assert sent and reg.proc.poll() is None  # cut by the proxy, the registry still up
    assert f"ended after {sent[0][0]} of {sent[0][1]} bytes" in line
    assert listing(dst) == before, line
    assert set(plan_states(tiny_ckpt_ro, dst).values()) == {"HIT", "MISS"}  # the one entry still hits


def test_an_untrusted_signer_is_refused_before_any_blob_is_fetched(pushed, tiny_ckpt_ro, tmp_path):
    reg, _, _ = pushed
    _, other_trusted = make_keys(tmp_path, "someone-else")
    dst = tmp_path / "fresh"
    with proxy(reg) as (target, seen):
        one_line_refusal(pull(target, tiny_ckpt_ro, dst, other_trusted, "--insecure"), "not trusted")
    assert [p for p in seen if "/manifests/" in p] and blobs(seen) == []
    assert listing(dst) == []


def test_a_trusted_key_id_over_another_entry_fetches_no_artifact(pushed, tiny_ckpt_ro, tmp_path, cold_export_launch):
    """Each artifact in the registry carries another entry's signature (by the trusted key): the
    entry manifest (a small first layer) is fetched to check it, no artifact is."""
    reg, _, trusted = pushed
    src = Client(Repository.parse(f"{reg.address}/{REPO}", insecure=True))
    forged = Client(Repository.parse(f"{reg.address}/{REPO}-forged", insecure=True))
    root = cold_export_launch[0] / "v1"
    fps = [fp.name for program in sorted(root.iterdir()) if not program.name.startswith(".")
           for fp in program.iterdir() if not fp.name.startswith(".")]
    docs = [json.loads(src.get_manifest(fp)[0]) for fp in fps]
    assert len(docs) >= 2
    for i, (fp, doc) in enumerate(zip(fps, docs, strict=True)):
        for d in [doc["config"], *doc["layers"]]:
            forged.put_blob(src.get_blob(d["digest"], d["size"]))
        other = docs[(i + 1) % len(docs)]["annotations"][oci.A_SIGNATURE]
        forged.put_manifest(fp, json.dumps({**doc, "annotations": {**doc["annotations"], oci.A_SIGNATURE: other}})
                            .encode())
    dst = tmp_path / "fresh"
    with proxy(reg) as (target, seen):
        one_line_refusal(pull(target.replace(REPO, f"{REPO}-forged"), tiny_ckpt_ro, dst, trusted, "--insecure"),
                         "is not over this entry")
    assert len(blobs(seen)) == 1  # the first entry's manifest layer, nothing after it
    assert listing(dst) == []


def test_push_speaks_plain_http_only_with_insecure(pushed, cold_export_launch, tiny_ckpt_ro):
    reg, key, _ = pushed
    target = f"{reg.address}/{REPO}-plain"
    push = ("cache", "push", target, "--model", tiny_ckpt_ro, *LAUNCH, "--kernel-cache-dir", cold_export_launch[0],
            "--signing-key", key)
    fp = next(fp.name for program in sorted((cold_export_launch[0] / "v1").iterdir())
              if not program.name.startswith(".") for fp in program.iterdir() if not fp.name.startswith("."))
    client = Client(Repository.parse(target, insecure=True))
    one_line_refusal(dsv4(*push), reg.address, "--insecure")
    assert client.get_manifest(fp) is None  # nothing was pushed
    done = dsv4(*push, "--insecure")
    assert done.returncode == 0, done.stderr
    assert client.get_manifest(fp) is not None


def test_config_is_the_key(pushed, cold_export_launch):
    """The config blob's digest is the fingerprint: the key travels as the artifact's config."""
    reg, _, _ = pushed
    program = sorted(p.name for p in (cold_export_launch[0] / "v1").iterdir() if not p.name.startswith("."))[0]
    fp = next(p.name for p in (cold_export_launch[0] / "v1" / program).iterdir() if not p.name.startswith("."))
    client = Client(Repository.parse(f"{reg.address}/{REPO}", insecure=True))
    doc = json.loads(client.get_manifest(fp)[0])
    config = client.get_blob(doc["config"]["digest"], doc["config"]["size"])
    from store.kernel_cache.entry import key_from_json

    assert fingerprint(key_from_json(json.loads(config))) == fp


def test_registry_credentials_come_from_dockers_config(tmp_path, monkeypatch):
    import base64

    from store.registry import docker_credentials

    (tmp_path / "config.json").write_text(json.dumps({"auths": {
        "https://registry.example.com": {"auth": base64.b64encode(b"ops:s3cret").decode()},
        "other.example.com:5000": {"username": "ci", "password": "pw"},
    }}))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert docker_credentials("registry.example.com") == ("ops", "s3cret")
    assert docker_credentials("other.example.com:5000") == ("ci", "pw")
    assert docker_credentials("unknown.example.com") is None


def test_a_repository_name_is_checked_before_anything_is_sent():
    from store.registry import RegistryError

    for bad in ("registry.example.com", "registry.example.com/Upper", "https://r.example.com/x"):
        with pytest.raises(RegistryError):
            Repository.parse(bad)
    assert Repository.parse("r.example.com:5000/dsv4/programs", insecure=True).url == \
        "http://r.example.com:5000/v2/dsv4/programs"
