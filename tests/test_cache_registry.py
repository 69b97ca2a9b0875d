"""Kernel-cache entries through a real OCI registry (Debian's docker-registry, the CNCF
distribution server, started here on 127.0.0.1): push, pull exactly what a launch misses, and the
hostile registry cases — each one line, nothing installed (issue 34)."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.request

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
    """Forwards to the registry; stops it at the first blob request (after the manifests)."""

    upstream = ""
    on_blob = staticmethod(lambda: None)

    def do_GET(self):
        if "/blobs/" in self.path:
            type(self).on_blob()
            self.close_connection = True
            return  # the registry is gone: the connection drops without an answer
        try:
            with urllib.request.urlopen(urllib.request.Request(
                    f"http://{self.upstream}{self.path}", headers={"Accept": self.headers.get("Accept", "")})) as r:
                body = r.read()
                self.send_response(r.status)
                for k in ("Content-Type", "Docker-Content-Digest"):
                    if r.headers.get(k):
                        self.send_header(k, r.headers[k])
        except urllib.error.HTTPError as e:
            body = e.read()
            self.send_response(e.code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_registry_stopping_mid_pull(tmp_path, cold_export_launch, tiny_ckpt_ro):
    key, trusted = make_keys(tmp_path, "builder")
    with registry(tmp_path / "srv") as reg:
        assert dsv4("cache", "push", f"{reg.address}/{REPO}", "--model", tiny_ckpt_ro, *LAUNCH,
                    "--kernel-cache-dir", cold_export_launch[0], "--signing-key", key, "--insecure").returncode == 0
        handler = type("Proxy", (_Proxy,), {"upstream": reg.address, "on_blob": staticmethod(reg.stop)})
        proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        try:
            dst = tmp_path / "fresh"
            line = one_line_refusal(pull(f"127.0.0.1:{proxy.server_address[1]}/{REPO}", tiny_ckpt_ro, dst, trusted,
                                         "--insecure"), "/blobs/")
            assert reg.proc.poll() is not None, "the registry was stopped mid-pull"
            assert listing(dst) == [], line
        finally:
            proxy.shutdown()
            proxy.server_close()


def test_pulled_entries_need_a_trusted_signer(pushed, tiny_ckpt_ro, tmp_path):
    reg, _, _ = pushed
    _, other_trusted = make_keys(tmp_path, "someone-else")
    dst = tmp_path / "fresh"
    one_line_refusal(pull(f"{reg.address}/{REPO}", tiny_ckpt_ro, dst, other_trusted, "--insecure"), "not trusted")
    assert listing(dst) == []


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
