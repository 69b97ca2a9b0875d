"""How a client reaches a `dsv4 serve` that wants an API key or speaks TLS: one value every
client takes (the console's scrape of /health and /metrics, the fleet, the benches).

`Access.of(--api-key-file, --ca-file)` holds the key file's first key (`$DSV4_API_KEY_FILE` when
no flag names one) and the CA file that vouches for the service's certificate (`$DSV4_CA_FILE`;
none: the system's CAs). It makes the request headers and the TLS context, and turns what went
wrong into the one line a user reads: a 401 ("the service needs an API key"), a certificate it
cannot verify. Torch-free and FastAPI-free (the console imports it).
"""

from __future__ import annotations

import functools
import http.client
import os
import ssl
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from store.api_keys import SecretFileError, key_file, read_keys

CA_ENV = "DSV4_CA_FILE"
MAX_BODY = 1 << 20


@dataclass(frozen=True)
class Reply:
    """A GET's answer: the status (None: nothing answered), the body, and what the client must
    fix, in one line (a 401, a certificate it cannot verify; else "")."""

    status: int | None
    body: bytes = b""
    problem: str = ""


@dataclass(frozen=True)
class Access:
    key: str | None = field(default=None, repr=False)
    key_name: str = ""
    key_file: Path | None = None
    ca_file: Path | None = None

    @classmethod
    def of(cls, api_key_file: Path | str | None = None, ca_file: Path | str | None = None) -> Access:
        """The key of `api_key_file` (else $DSV4_API_KEY_FILE's; neither: no key) and the CA file
        (else $DSV4_CA_FILE). A key file that cannot be used is one line (SecretFileError)."""
        path = key_file(api_key_file)
        first = read_keys(path)[0] if path is not None else None
        ca = ca_file or os.environ.get(CA_ENV)
        access = cls(first.key if first else None, first.name if first else "", path,
                     Path(ca).expanduser() if ca else None)
        if access.ca_file is not None:
            access.ssl_context  # noqa: B018 (a CA file that cannot serve is one line now, not at the first https)
        return access

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    @functools.cached_property
    def ssl_context(self) -> ssl.SSLContext:
        """Verifies the service's certificate and name: against the CA file when given, else
        the system's CAs."""
        if self.ca_file is not None and not self.ca_file.is_file():  # never open a FIFO: it would block
            raise SecretFileError(f"--ca-file {self.ca_file}: no such file")
        try:
            return ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
        except (OSError, ssl.SSLError) as e:
            raise SecretFileError(f"--ca-file {self.ca_file}: not PEM CA certificates "
                                  f"({getattr(e, 'strerror', None) or getattr(e, 'reason', None) or e})") from None

    def httpx_options(self) -> dict:
        """Keyword arguments of an httpx client (or call) that carry this access."""
        return {"headers": self.headers(), "verify": self.ssl_context}

    def problem(self, url: str, status: int | None = None, error: BaseException | None = None) -> str:
        """The one line for a refused request (401) or a failed connection."""
        if status == 401:
            if self.key is None:
                return (f"401: the service needs an API key ({url}); pass --api-key-file FILE or set "
                        f"$DSV4_API_KEY_FILE")
            return f"401: the service at {url} refused the key {self.key_name!r} of {self.key_file}"
        if isinstance(error, ssl.SSLCertVerificationError):
            reason = error.verify_message or str(error)
            hint = "pass --ca-file with the CA that signed it" if self.ca_file is None else \
                f"it is not signed by the CA of --ca-file {self.ca_file}, or not for this address"
            return f"{url}: its TLS certificate cannot be verified ({reason}); {hint}"
        if isinstance(error, ssl.SSLError):
            return f"{url}: TLS failed ({error.reason or error}); does the service want a client certificate?"
        if url.startswith("https:") and isinstance(error, http.client.RemoteDisconnected | ConnectionResetError):
            # TLS 1.3 sends the server's refusal of a missing client certificate after the handshake
            return f"{url}: closed the connection without answering; does the service want a client certificate?"
        return ""  # nothing answered, or it answered: nothing a key or a CA file would change

    def get(self, url: str, path: str, timeout: float, cap: int = MAX_BODY) -> Reply:
        """GET url+path with this access: http or https as the URL says."""
        parts = urllib.parse.urlsplit(url)
        if not parts.hostname:
            return Reply(None, b"", f"{url}: not a service URL")
        if parts.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                parts.hostname, parts.port or 443, timeout=timeout, context=self.ssl_context)
        else:
            conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
        try:
            conn.request("GET", path, headers=self.headers())
            response = conn.getresponse()
            body = response.read(cap)
            return Reply(response.status, body, self.problem(url, response.status))
        except (OSError, http.client.HTTPException) as e:
            return Reply(None, b"", self.problem(url, error=e))
        finally:
            conn.close()


NO_ACCESS = Access()
