"""A service over a fake engine, served for real in this process, and what its door needs.

`served(...)`: the app (`runtime.serve.app.create_app`) under a real uvicorn on a loopback port, in
a thread, with the settings `dsv4 serve` uses (`runtime.serve.server.server_config`: the door's
keys and TLS, the h11 protocol with its deadlines): sockets, TLS, timeouts and the event loop
are real, only the model is not (tests/engine_fakes.CountingEngine). `key_file` and `make_pki`
write the API keys and the CA, server and client certificates a test needs, per run (the
`cryptography` package). `Leaks` is the invariant every hostile test ends with: free KV slots,
running requests and open descriptors back where they were.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
from engine_fakes import CountingEngine

VOCAB, MAX_SEQ = 512, 64
_TOKENIZER_JSON: dict[int, str] = {}


def fake_launched(tmp_path: Path, slots: int = 2, engine=None, max_seq: int = MAX_SEQ):
    """What registration hands the service, around a fake engine and a real tokenizer.json."""
    from runtime.model.tokenizer import load_tokenizer
    from runtime.synth.tokenizer import train_tokenizer_json

    if VOCAB not in _TOKENIZER_JSON:  # trained once per session: the same text every time
        _TOKENIZER_JSON[VOCAB] = train_tokenizer_json(VOCAB)
    (tmp_path / "tokenizer.json").write_text(_TOKENIZER_JSON[VOCAB])
    tokenizer, _ = load_tokenizer(tmp_path, VOCAB)
    listeners: list = []
    launched = SimpleNamespace(engine=engine or CountingEngine(slots=slots, max_seq=max_seq), tokenizer=tokenizer,
                               config=SimpleNamespace(vocab_size=VOCAB), spec=SimpleNamespace(model=tmp_path),
                               programs=SimpleNamespace(dims=SimpleNamespace(max_seq=max_seq)), phases={},
                               failure=None, on_failure=listeners.append)

    def fail(reason: str) -> None:
        launched.failure = reason
        for listener in listeners:
            listener(reason)

    launched.fail = fail
    return launched


@dataclass
class Served:
    url: str
    app: object
    server: object
    host: str
    port: int
    kw: dict = field(default_factory=dict)  # httpx options that get in: the key, the CA

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=30, **self.kw).json()

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=30, **{**self.kw, **kw})

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", timeout=60, **{**self.kw, **kw})


@contextlib.contextmanager
def served(launched, limits=None, door=None, host: str = "127.0.0.1", access=None):
    """The app over `launched`, served by uvicorn on a free port of `host` until the block ends;
    every job is stopped after. `access` (runtime.serve.access.Access): how `Served`'s own
    requests get in."""
    import uvicorn

    from runtime.serve.app import Limits, create_app
    from runtime.serve.auth import OPEN_DOOR
    from runtime.serve.server import server_config, url_of

    limits, door = limits or Limits(), door or OPEN_DOOR
    app = create_app(launched, limits, door=door)
    server = uvicorn.Server(server_config(app, limits, door))
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="served")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.01)
    try:
        yield Served(url_of(sock, door.tls is not None), app, server, host, sock.getsockname()[1],
                     access.httpx_options() if access is not None else {})
    finally:
        server.should_exit = True
        thread.join(60)
        sock.close()
        app.state.scheduler.close()


def key_file(path: Path, mode: int = 0o600, **keys: str) -> Path:
    """An API key file holding `keys` (name=key), with a comment and a blank line."""
    path.write_text("# name key\n\n" + "".join(f"{name} {key}\n" for name, key in keys.items()))
    path.chmod(mode)
    return path


@dataclass(frozen=True)
class PKI:
    ca: Path  # the CA's certificate: what a client's --ca-file and the server's --ssl-ca-certs hold
    cert: Path  # the server's certificate, for 127.0.0.1 and localhost
    key: Path
    client_cert: Path  # a client certificate the CA signed
    client_key: Path
    other_ca: Path  # a CA that signed none of these


def make_pki(directory: Path, host: str = "127.0.0.1") -> PKI:
    """A CA, a server certificate for `host` and localhost, and a client certificate, each
    private key mode 600; and a second, unrelated CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write_key(key, path: Path) -> Path:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        path.chmod(0o600)
        return path

    def certificate(subject, key, issuer, issuer_key, ca: bool, extra=()):
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            b = b.add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                              content_commitment=False, key_encipherment=False,
                                              data_encipherment=False, key_agreement=False, encipher_only=False,
                                              decipher_only=False), critical=True)
            b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        else:
            b = b.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                                critical=False)
        for ext in extra:
            b = b.add_extension(ext, critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def pem(cert, path: Path) -> Path:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    directory.mkdir(parents=True, exist_ok=True)
    ca_key, other_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate(name("dsv4 test CA"), ca_key, name("dsv4 test CA"), ca_key, True)
    other = certificate(name("another CA"), other_key, name("another CA"), other_key, True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host)), x509.DNSName("localhost")])
    server = certificate(name(host), server_key, ca.subject, ca_key, False,
                         (san, x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH])))
    client = certificate(name("a client"), client_key, ca.subject, ca_key, False,
                         (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),))
    return PKI(pem(ca, directory / "ca.pem"), pem(server, directory / "server.pem"),
               write_key(server_key, directory / "server.key"), pem(client, directory / "client.pem"),
               write_key(client_key, directory / "client.key"), pem(other, directory / "other-ca.pem"))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Leaks:
    """The invariant a hostile test ends with: the service's free KV slots, running and queued
    requests, and this process's open descriptors back where they were (waited for: a slot is
    freed within one step, a connection within its deadline)."""

    def __init__(self, svc: Served, fd_slack: int = 2):
        self.svc, self.fd_slack = svc, fd_slack
        self.before = self._figures()

    def _figures(self) -> tuple[int, int, int, int]:
        h = self.svc.health()
        return h["free_slots"], h["running"], h["queued"], h["open_fds"]

    def check(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            now = self._figures()
            same = now[:3] == self.before[:3] and now[3] <= self.before[3] + self.fd_slack
            if same or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert same, f"leaked: (free slots, running, queued, open fds) {self.before} -> {now}"
