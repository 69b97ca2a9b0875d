"""A service's API keys on disk (`dsv4 serve --api-key-file FILE`, `$DSV4_API_KEY_FILE`), and
the secret files beside them (a TLS private key): read safely or refused in one line.

The key file is text, one key a line, its name first:

    # who        key (16 to 4096 printable ASCII characters, no spaces)
    gateway      Jq3…32 random bytes, base64url…
    batch-jobs   7f1c…

`#` starts a comment line; blank lines are skipped. A name (letters, digits, `_ . @ -`, at most 64)
is what /metrics counts and the access log shows: the key itself is never written anywhere. A
client (the console, the benches) uses the first key of the file it is given.

A secret file is refused unless it is a regular file owned by you (or root) that others can
neither read nor write and its group cannot write: a key readable by every user of the host is
no secret, and one that another user can rewrite lets them in. Errors name the file and the
line, never the key. Torch-free; imports nothing of the project but `store`.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from store import safeio
from store.errors import UserError

API_KEY_ENV = "DSV4_API_KEY_FILE"
MAX_SECRET_FILE_BYTES = 1 << 20
MAX_KEYS = 4096
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
KEY = re.compile(r"[\x21-\x7e]{16,4096}")  # printable ASCII: what an HTTP header carries as is


class SecretFileError(UserError):
    """A key file (or TLS private key) that cannot be used: missing, malformed, or not private."""


@dataclass(frozen=True)
class ApiKey:
    name: str
    key: str = field(repr=False)  # never in a repr, a log line or an error


def secret_problem(st: os.stat_result) -> str | None:
    """Why a secret file with this stat must not be trusted, or None."""
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file ({safeio.kind(st.st_mode)})"
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, neither you nor root"
    if st.st_mode & 0o026:
        return (f"readable or writable by others, or writable by its group (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"run `chmod 600` on it")
    return None


def read_secret(path: Path, what: str) -> bytes:
    """The bytes of a secret file, checked on the descriptor that is read (a path swapped
    between the check and the read changes nothing)."""
    try:
        fd = safeio.open_regular(path)
    except FileNotFoundError:
        raise SecretFileError(f"{what} {path}: no such file") from None
    except OSError as e:
        raise SecretFileError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    try:
        if problem := secret_problem(os.fstat(fd)):
            raise SecretFileError(f"{what} {path}: refused: it is {problem}")
        try:
            return safeio.read_fd(fd, MAX_SECRET_FILE_BYTES, path.name)
        except OSError as e:
            raise SecretFileError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    finally:
        os.close(fd)


def parse_keys(text: str, where: str) -> tuple[ApiKey, ...]:
    """The keys of a key file's text; SecretFileError naming `where` and the line otherwise."""
    keys: list[ApiKey] = []
    names: set[str] = set()
    secrets: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise SecretFileError(f"{where}:{n}: expected `NAME KEY` (two fields), found {len(parts)}")
        name, key = parts
        if not NAME.fullmatch(name):
            raise SecretFileError(f"{where}:{n}: a key's name is 1 to 64 letters, digits or `_ . @ -`")
        if not KEY.fullmatch(key):
            raise SecretFileError(f"{where}:{n}: the key of {name!r} must be 16 to 4096 printable ASCII characters "
                                  f"(e.g. `python3 -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
        if name in names or key in secrets:
            raise SecretFileError(f"{where}:{n}: {'the name ' + repr(name) if name in names else 'the key'} "
                                  f"appears twice")
        names.add(name)
        secrets.add(key)
        keys.append(ApiKey(name, key))
        if len(keys) > MAX_KEYS:
            raise SecretFileError(f"{where}: more than {MAX_KEYS} keys")
    if not keys:
        raise SecretFileError(f"{where}: holds no key (one `NAME KEY` a line)")
    return tuple(keys)


def read_keys(path: Path) -> tuple[ApiKey, ...]:
    """Every key of the key file at `path` (at least one)."""
    raw = read_secret(path, "--api-key-file")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise SecretFileError(f"--api-key-file {path}: not a key file (not ASCII text)") from None
    return parse_keys(text, f"--api-key-file {path}")


def key_file(value: Path | str | None) -> Path | None:
    """The key file a flag names, else $DSV4_API_KEY_FILE's, else None (no keys)."""
    if value:
        return Path(value).expanduser()
    env = os.environ.get(API_KEY_ENV)
    return Path(env).expanduser() if env else None
