"""Who gets in: the service's `Door` (API keys, the paths open without one, TLS, the prefix a proxy
strips) and `RequireKey`, the ASGI middleware in front of every route.

A request passes with `Authorization: Bearer KEY` naming one of the service's keys
(`store.api_keys`), or when the route that will serve it is an open one (`open_paths`: none by
default; /health and /metrics with `--open-status`, for a load balancer's probe or a scraper
without the key). Everything else is a 401 with one sentence and `WWW-Authenticate: Bearer`,
before a byte of its body is read.

Two rules keep the door shut:
- the path judged is the one the router serves: Starlette's own `get_route_path` of the ASGI
  scope (its `path` less `root_path`, as the router strips it), never the URL rebuilt from the
  Host header (`Host: x/health?` made Starlette's `request.url.path` read /health while the
  router served /v1/completions: CVE-2026-48710), and only an exact match opens (`//health`,
  `/health/`, `%2F` or `..` forms are other paths, and need the key);
- the presented key is compared with every key, each as a SHA-256 digest in constant time, and
  the loop never stops early, so neither the time nor the answer says which key was near.

The accepted key's name is left on the request (`scope["state"]["api_key"]`: Starlette's
`request.state.api_key`) for the access log; every refusal and every accepted key is counted by
key name (never the key) through `count(name, result)`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from starlette._utils import get_route_path  # the router's own reading of the path

from store.api_keys import ApiKey, key_file, read_keys

STATUS_PATHS = frozenset({"/health", "/metrics"})
ACCEPTED, MISSING, WRONG = "accepted", "missing", "wrong"
NEEDS_KEY = "this service needs an API key: send `Authorization: Bearer KEY`"
WRONG_KEY = "the API key sent is not one this service accepts"


def bearer(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first Authorization header when it is `Bearer TOKEN`, else None."""
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None


def open_paths(status_needs_key: bool) -> frozenset[str]:
    """The route paths served without a key: none, or /health and /metrics (`--open-status`)."""
    return frozenset() if status_needs_key else STATUS_PATHS


@dataclass(frozen=True)
class Door:
    """Who gets in, and how they reach the service: its keys (none: no key needed), the paths
    open without one, its TLS context (None: plain HTTP), and the prefix a proxy strips."""

    keys: tuple[ApiKey, ...] = field(default=(), repr=False)
    open: frozenset[str] = frozenset()
    tls: ssl.SSLContext | None = None
    root_path: str = ""
    _digests: tuple[tuple[str, bytes], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        digests = tuple((k.name, hashlib.sha256(k.key.encode()).digest()) for k in self.keys)
        object.__setattr__(self, "_digests", digests)

    @classmethod
    def of(cls, spec) -> Door:
        """The door of a launch spec: its key file read and its TLS context made now, so a bad
        file is one line before registration (store.api_keys.SecretFileError)."""
        from runtime.serve.tls import server_context

        path = key_file(spec.api_key_file)
        return cls(read_keys(path) if path is not None else (), open_paths(spec.status_needs_key),
                   server_context(spec.ssl_certfile, spec.ssl_keyfile, spec.ssl_ca_certs), spec.root_path)

    def name_of(self, token: bytes) -> str | None:
        """The name of the key `token` is, or None: compared with every key, no early exit."""
        presented, found = hashlib.sha256(token).digest(), None
        for name, digest in self._digests:
            if hmac.compare_digest(presented, digest) and found is None:
                found = name
        return found

    def judge(self, headers: Iterable[tuple[bytes, bytes]], route_path: str) -> tuple[str | None, str]:
        """(the accepted key's name — "" for an open path or a door without keys — or None:
        refused; and the result counted: accepted | missing | wrong, "" when uncounted)."""
        if not self.keys:
            return "", ""
        token = bearer(headers)
        name = self.name_of(token) if token is not None else None
        if name is not None:
            return name, ACCEPTED
        if route_path in self.open:
            return "", ""
        return None, MISSING if token is None else WRONG


OPEN_DOOR = Door()  # no keys, no TLS: loopback's default


def refusal(result: str) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The 401 answer to a missing or wrong key: (status, headers, body) in OpenAI's error shape."""
    message = NEEDS_KEY if result == MISSING else WRONG_KEY
    challenge = b'Bearer realm="dsv4"' + (b', error="invalid_token"' if result == WRONG else b"")
    body = json.dumps({"error": {"message": message, "type": "authentication_error", "param": None,
                                 "code": "invalid_api_key" if result == WRONG else "missing_api_key"}}).encode()
    return 401, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                 (b"www-authenticate", challenge)], body


class RequireKey:
    """ASGI middleware: a request needs one of the door's keys unless its route path is open."""

    def __init__(self, app, door: Door, count: Callable[[str, str], None]):
        self.app, self.door, self.count = app, door, count

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):  # lifespan
            return await self.app(scope, receive, send)
        name, result = self.door.judge(scope.get("headers") or (), get_route_path(scope))
        if result:
            self.count(name or "", result)
        if name is not None:
            scope.setdefault("state", {})["api_key"] = name
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":  # none is served; refused all the same
            return await send({"type": "websocket.close", "code": 1008})
        status, headers, body = refusal(result)
        if (access := (scope.get("state") or {}).get("access")) is not None:  # its access line says why
            access.error = NEEDS_KEY if result == MISSING else WRONG_KEY
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
