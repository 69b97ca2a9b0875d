"""A small client of the OCI distribution API (what Harbor, Artifactory, ECR and the CNCF
distribution server speak): blobs up and down, manifests by tag, the operator's docker
credentials.

Why not oras-py: it writes pulled blobs to files without checking their digests, has no cap on
what a registry sends, and brings requests + jsonschema for four HTTP calls. Here every blob read
is capped at its descriptor's size (a registry that sends more is refused before the excess is
read) and hashed against its digest, in memory.

HTTPS always, plain HTTP only when asked (`insecure`, the CLI's --insecure). Credentials: the
`auths` of `$DOCKER_CONFIG/config.json` (default `~/.docker/config.json`), as `docker login`
writes them (base64 `user:password`, or `username` / `password`); credential helpers
(`credsStore`, `credHelpers`) are not run. Basic auth when the registry asks for it, and the
token flow (`WWW-Authenticate: Bearer realm=…`) the hosted registries use. Every failure (HTTP
status, refused or dropped connection, timeout) is one line (`RegistryError`).
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from store.errors import UserError

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MAX_MANIFEST_BYTES = 4 << 20  # the distribution server's own limit on manifests
_REPO = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_CHUNK = 1 << 20


class RegistryError(UserError):
    """A registry that cannot be reached, refuses a request, or sends what was not asked for."""


@dataclass(frozen=True)
class Repository:
    registry: str  # host[:port]
    name: str  # the repository path inside it
    insecure: bool = False  # plain HTTP

    @classmethod
    def parse(cls, text: str, *, insecure: bool = False) -> Repository:
        if "://" in text:
            raise RegistryError(f"{text}: write REGISTRY/REPO without a scheme (HTTPS; plain HTTP with --insecure)")
        registry, _, name = text.partition("/")
        if not registry or not name or _REPO.fullmatch(name) is None:
            raise RegistryError(f"{text}: expected REGISTRY/REPO, e.g. registry.example.com/dsv4/programs "
                                "(repository names are lowercase)")
        return cls(registry, name, insecure)

    @property
    def url(self) -> str:
        return f"{'http' if self.insecure else 'https'}://{self.registry}/v2/{self.name}"

    def __str__(self) -> str:
        return f"{self.registry}/{self.name}"


def docker_credentials(registry: str) -> tuple[str, str] | None:
    """(user, password) for `registry` from docker's config.json, or None."""
    base = os.environ.get("DOCKER_CONFIG") or str(Path.home() / ".docker")
    try:
        from store import safeio

        config = json.loads(safeio.read_regular(Path(base) / "config.json", 1 << 20))
        auths = config.get("auths") or {}
    except (OSError, ValueError, AttributeError):
        return None
    for name, entry in auths.items() if isinstance(auths, dict) else ():
        host = urllib.parse.urlsplit(name if "://" in name else f"//{name}").netloc
        if host != registry or not isinstance(entry, dict):
            continue
        if entry.get("username") and entry.get("password"):
            return str(entry["username"]), str(entry["password"])
        try:
            user, sep, password = base64.b64decode(str(entry.get("auth", ""))).decode().partition(":")
        except (ValueError, UnicodeDecodeError):
            return None
        return (user, password) if sep else None
    return None


class Client:
    """One repository's blobs and manifests."""

    def __init__(self, repo: Repository, timeout: float = 60.0):
        self.repo, self.timeout = repo, timeout
        self.credentials = docker_credentials(repo.registry)
        self.authorization: str | None = None

    # -- HTTP ------------------------------------------------------------------------------

    def _open(self, method: str, url: str, data: bytes | None = None, headers: dict[str, str] | None = None,
              *, missing_ok: bool = False, _retry: bool = True) -> http.client.HTTPResponse | None:
        req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
        if self.authorization:
            # not forwarded on redirects: blob downloads are often redirected to object storage
            req.add_unredirected_header("Authorization", self.authorization)
        what = f"{self.repo.registry}: {method} {urllib.parse.urlsplit(url).path}"
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            challenge = e.headers.get("WWW-Authenticate", "")
            e.close()
            if e.code == 401 and _retry and self._authenticate(challenge):
                return self._open(method, url, data, headers, missing_ok=missing_ok, _retry=False)
            if e.code == 404 and missing_ok:
                return None
            hint = " (docker login to it, or check the repository's permissions)" if e.code in (401, 403) else ""
            raise RegistryError(f"{what}: HTTP {e.code} {e.reason}{hint}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            reason = getattr(e, "reason", None) or e
            # HTTPS to a registry that speaks plain HTTP fails in its TLS handshake
            hint = "; if it speaks plain HTTP, pass --insecure" if isinstance(reason, ssl.SSLError) else ""
            raise RegistryError(f"{what}: {reason}{hint}") from None

    def _authenticate(self, challenge: str) -> bool:
        """Answer a 401's challenge: basic with docker's credentials, or a bearer token."""
        scheme, _, params = challenge.partition(" ")
        if scheme.lower() == "basic" and self.credentials:
            self.authorization = "Basic " + base64.b64encode(":".join(self.credentials).encode()).decode()
            return True
        if scheme.lower() != "bearer":
            return False
        fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
        if "realm" not in fields:
            return False
        query = urllib.parse.urlencode({k: v for k, v in fields.items() if k in ("service", "scope")})
        req = urllib.request.Request(f"{fields['realm']}?{query}")
        if self.credentials:
            req.add_header("Authorization", "Basic " + base64.b64encode(":".join(self.credentials).encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                body = json.loads(r.read(1 << 20))
        except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as e:
            raise RegistryError(f"{self.repo.registry}: token from {fields['realm']}: {e}") from None
        token = body.get("token") or body.get("access_token") if isinstance(body, dict) else None
        if not token:
            return False
        self.authorization = f"Bearer {token}"
        return True

    # -- blobs and manifests -----------------------------------------------------------------

    def has_blob(self, digest: str) -> bool:
        r = self._open("HEAD", f"{self.repo.url}/blobs/{digest}", missing_ok=True)
        if r is not None:
            r.close()
        return r is not None

    def put_blob(self, data: bytes) -> str:
        """Upload `data` (monolithic: POST for a location, one PUT) unless the registry has it."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self.has_blob(digest):
            return digest
        r = self._open("POST", f"{self.repo.url}/blobs/uploads/", b"")
        location = r.headers.get("Location", "")
        r.close()
        url = urllib.parse.urljoin(self.repo.url, location)
        sep = "&" if "?" in url else "?"
        self._open("PUT", f"{url}{sep}digest={urllib.parse.quote(digest)}", data,
                   {"Content-Type": "application/octet-stream"}).close()
        return digest

    def put_manifest(self, tag: str, body: bytes, media_type: str = OCI_MANIFEST) -> str:
        self._open("PUT", f"{self.repo.url}/manifests/{tag}", body, {"Content-Type": media_type}).close()
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def get_manifest(self, tag: str, media_type: str = OCI_MANIFEST) -> tuple[bytes, str] | None:
        """(body, digest) of the manifest tagged `tag`, or None when there is none."""
        r = self._open("GET", f"{self.repo.url}/manifests/{tag}", headers={"Accept": media_type}, missing_ok=True)
        if r is None:
            return None
        body = self._read(r, MAX_MANIFEST_BYTES, f"manifest {tag}")
        return body, "sha256:" + hashlib.sha256(body).hexdigest()

    def get_blob(self, digest: str, size: int) -> bytes:
        """The blob `digest`, exactly `size` bytes (its descriptor's), hashed against `digest`."""
        r = self._open("GET", f"{self.repo.url}/blobs/{digest}")
        data = self._read(r, size, f"blob {digest[:19]}")
        if len(data) != size:
            raise RegistryError(f"{self.repo}: blob {digest[:19]} ended after {len(data)} of {size} bytes")
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise RegistryError(f"{self.repo}: blob {digest[:19]} does not match its digest")
        return data

    def _read(self, r: http.client.HTTPResponse, cap: int, what: str) -> bytes:
        """At most `cap` bytes of a response; a longer one is refused without reading on."""
        with r:
            length = r.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > cap:
                raise RegistryError(f"{self.repo}: {what} is {length} bytes, more than the {cap} it should be")
            parts, got = [], 0
            try:
                while got <= cap:
                    chunk = r.read(min(_CHUNK, cap + 1 - got))
                    if not chunk:
                        break
                    parts.append(chunk)
                    got += len(chunk)
            except (OSError, http.client.HTTPException) as e:
                raise RegistryError(f"{self.repo}: reading {what}: {e or type(e).__name__}") from None
        if got > cap:
            raise RegistryError(f"{self.repo}: {what} is more than the {cap} bytes it should be")
        return b"".join(parts)
