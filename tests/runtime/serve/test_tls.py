"""HTTPS for the service, and the clients' side of the door (runtime.serve.access): certificates
made per run (door_fakes.make_pki); a certificate a client cannot verify, a missing key and a
wrong one are each one line; client certificates when --ssl-ca-certs asks for them; the
registering answerer holds the same door."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from door_fakes import Leaks, fake_launched, key_file, make_pki, served

from console.data.services import health
from runtime.serve.access import Access
from runtime.serve.auth import Door, open_paths
from runtime.serve.tls import server_context
from store.api_keys import SecretFileError, read_keys

KEY = "k" * 40


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    return key_file(tmp_path_factory.mktemp("keys") / "keys", console=KEY)


def test_https_with_the_ca_file_and_the_key_reads_health(tmp_path, pki, keys):
    door = Door(read_keys(keys), open_paths(True), server_context(pki.cert, pki.key))
    access = Access.of(keys, pki.ca)
    with served(fake_launched(tmp_path), door=door, access=access) as svc:
        assert svc.url.startswith("https://127.0.0.1:")
        leaks = Leaks(svc)
        word, value, problem = health(svc.url, access)
        assert (word, problem) == ("ok", "") and value.ok
        r = httpx.post(f"{svc.url}/v1/completions", json={"prompt": [1], "max_tokens": 2}, **access.httpx_options())
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
        # without the key: the console's one line, no figures
        word, value, problem = health(svc.url, Access.of(None, pki.ca))
        assert word == "HTTP 401" and value is None
        assert problem == (f"401: the service needs an API key ({svc.url}); "
                           "pass --api-key-file FILE or set $DSV4_API_KEY_FILE")
        wrong = key_file(tmp_path / "wrong", console="w" * 40)
        problem = health(svc.url, Access.of(wrong, pki.ca))[2]
        assert problem == f"401: the service at {svc.url} refused the key 'console' of {wrong}"
        # a certificate this client cannot verify: refused, in one line
        problem = health(svc.url, Access.of(keys, None))[2]
        assert problem.startswith(f"{svc.url}: its TLS certificate cannot be verified (")
        assert problem.endswith("pass --ca-file with the CA that signed it") and "\n" not in problem
        problem = health(svc.url, Access.of(keys, pki.other_ca))[2]
        assert f"it is not signed by the CA of --ca-file {pki.other_ca}" in problem
        # plain HTTP to the TLS port: refused without a 5xx
        with pytest.raises(httpx.HTTPError):
            r = httpx.get(svc.url.replace("https", "http") + "/health", timeout=10)
            assert r.status_code < 500
        leaks.check()


def test_a_client_certificate_is_required_when_ssl_ca_certs_is_given(tmp_path, pki, keys):
    door = Door((), frozenset(), server_context(pki.cert, pki.key, pki.ca))
    with served(fake_launched(tmp_path), door=door) as svc:
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        ctx.load_cert_chain(pki.client_cert, pki.client_key)
        assert httpx.get(f"{svc.url}/health", verify=ctx, timeout=30).status_code == 200
        problem = health(svc.url, Access.of(None, pki.ca))[2]  # the console presents none
        assert problem.endswith("does the service want a client certificate?"), problem
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{svc.url}/health", verify=ssl.create_default_context(cafile=str(pki.ca)), timeout=30)


def test_tls_files_that_cannot_serve_are_one_line(tmp_path, pki):
    public_key = tmp_path / "public.key"
    public_key.write_bytes(pki.key.read_bytes())
    public_key.chmod(0o644)
    with pytest.raises(SecretFileError,
                       match=r"--ssl-keyfile .*public.key: refused: it is readable or writable by others"):
        server_context(pki.cert, public_key)
    with pytest.raises(SecretFileError, match="cannot serve TLS with them"):
        server_context(pki.client_cert, pki.key)  # a certificate with another certificate's key
    with pytest.raises(SecretFileError, match="--ssl-ca-certs .*: not PEM CA certificates"):
        server_context(pki.cert, pki.key, pki.key)
    fifo = tmp_path / "cert.fifo"
    import os

    os.mkfifo(fifo)
    with pytest.raises(SecretFileError, match="not a regular file"):  # never blocks on the open
        server_context(fifo, pki.key)
    with pytest.raises(SecretFileError, match="--ca-file .*: no such file"):
        Access.of(None, tmp_path / "missing.pem")


@pytest.mark.slow  # waits out the answerer's 10 s handshake deadline
def test_the_registering_answer_holds_the_same_door(tmp_path, pki, keys):
    from runtime.serve.registering import Registering, answer_while_registering

    spec = SimpleNamespace(model=Path("/m/ckpt"), max_seq=64, backend="eager", device="cpu")
    identity = SimpleNamespace(host="h", pid=1, started=1.0)
    door = Door(read_keys(keys), open_paths(True), server_context(pki.cert, pki.key))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    stop = answer_while_registering(sock, Registering(spec, identity), door)
    url = f"https://127.0.0.1:{sock.getsockname()[1]}"
    try:
        access = Access.of(keys, pki.ca)
        r = httpx.get(f"{url}/health", timeout=30, **access.httpx_options())
        assert r.status_code == 503 and r.json()["status"] == "registering"
        bare = httpx.get(f"{url}/health", timeout=30, verify=access.ssl_context)
        assert bare.status_code == 401 and bare.headers["www-authenticate"].startswith("Bearer")
        assert httpx.get(f"{url}//health", timeout=30, verify=access.ssl_context).status_code == 401
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", sock.getsockname()[1])) as s:  # no handshake, no bytes
            s.settimeout(60)
            assert s.recv(1) == b""  # closed by the answerer's deadline
        assert time.monotonic() - t0 < 60
    finally:
        stop()
        sock.close()
