"""HTTPS for `dsv4 serve`: the server's TLS context from --ssl-certfile/--ssl-keyfile (and
--ssl-ca-certs: clients must present a certificate it signed), made once before registration so a
bad file is one line at once, and used by uvicorn and by the registering answerer alike.

The files are checked before `ssl` opens them (a FIFO there would block the open forever); the
private key must be private (`store.api_keys.secret_problem`). TLS 1.2 at least.
"""

from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

from store import safeio
from store.api_keys import SecretFileError, read_secret


def _regular(path: Path, flag: str) -> str:
    try:
        st = os.stat(path)
    except OSError as e:
        raise SecretFileError(f"{flag} {path}: cannot read it ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise SecretFileError(f"{flag} {path}: not a regular file ({safeio.kind(st.st_mode)})")
    return str(path)


def server_context(certfile: Path | None, keyfile: Path | None, ca_certs: Path | None = None) -> ssl.SSLContext | None:
    """The server's TLS context, or None for plain HTTP; SecretFileError (one line) for a file
    that cannot serve."""
    if certfile is None or keyfile is None:
        return None
    read_secret(keyfile, "--ssl-keyfile")  # refused unless private, before ssl reads it
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(_regular(certfile, "--ssl-certfile"), _regular(keyfile, "--ssl-keyfile"))
    except (ssl.SSLError, OSError) as e:
        raise SecretFileError(f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile}: cannot serve TLS with them "
                              f"({getattr(e, 'reason', None) or e}); "
                              "a PEM certificate and its own private key") from None
    if ca_certs is not None:
        try:
            ctx.load_verify_locations(cafile=_regular(ca_certs, "--ssl-ca-certs"))
        except (ssl.SSLError, OSError) as e:
            raise SecretFileError(f"--ssl-ca-certs {ca_certs}: not PEM CA certificates "
                                  f"({getattr(e, 'reason', None) or e})") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
