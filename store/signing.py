"""Signing keys and trusted keys: who built a kernel-cache entry that came from elsewhere.

ed25519 (the `cryptography` package), in the formats Nix's binary caches use, so an operator
who has run one recognises them:

- a **signing key** file holds one line `NAME:BASE64` where BASE64 is the 64-byte ed25519
  secret (the 32-byte seed, then the 32-byte public key). It is refused unless it is a regular
  file owned by this user and readable by nobody else (mode 0600 or stricter).
- a **public key** is one line `NAME BASE64 ID`: the name, the base64 of the 32-byte public key,
  and its short id (the first 16 hex digits of the key's sha256). `dsv4 keys show` prints it.
- a **trusted keys** file lists such lines, one per key (blank lines and `#` comments
  ignored; the ID may be left out, and when given must be the key's own).

A signature is over a message the caller builds (`store.kernel_cache.bundle.signed_message`:
what an entry *is*), never over a file name.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from store import safeio
from store.errors import UserError
from store.fingerprint import sha256_hex

SIGNING_KEY_ENV = "DSV4_SIGNING_KEY"
TRUSTED_KEYS_ENV = "DSV4_TRUSTED_KEYS"
MAX_KEY_FILE_BYTES = 64 << 10


class KeyFileError(UserError):
    """A key file that cannot be used (missing, malformed, readable by others)."""


def key_id(public: bytes) -> str:
    """The short id a public key is named by in error lines and origins."""
    return sha256_hex(public)[:16]


@dataclass(frozen=True)
class PublicKey:
    name: str
    raw: bytes  # the 32-byte ed25519 public key

    @property
    def id(self) -> str:
        return key_id(self.raw)

    def line(self) -> str:
        """The key as one line of a trusted-keys file."""
        return f"{self.name} {base64.b64encode(self.raw).decode()} {self.id}"

    def verifies(self, signature: bytes, message: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
        except (InvalidSignature, ValueError):
            return False
        return True


@dataclass(frozen=True)
class SigningKey:
    name: str
    seed: bytes = field(repr=False)  # the 32-byte ed25519 private seed

    def _private(self):
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return Ed25519PrivateKey.from_private_bytes(self.seed)

    @property
    def public(self) -> PublicKey:
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        raw = self._private().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        return PublicKey(self.name, raw)

    def sign(self, message: bytes) -> bytes:
        return self._private().sign(message)

    def line(self) -> str:
        return f"{self.name}:{base64.b64encode(self.seed + self.public.raw).decode()}"

    @classmethod
    def generate(cls, name: str) -> SigningKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
        from cryptography.hazmat.primitives.serialization import (
            Encoding,
            NoEncryption,
            PrivateFormat,
        )

        seed = Ed25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        return cls(check_name(name), seed)


def check_name(name: str) -> str:
    if not name or any(c.isspace() or c == ":" for c in name):
        raise KeyFileError(f"key name {name!r}: must be non-empty, without spaces or ':'")
    return name


def _b64(text: str, size: int, where: str) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise KeyFileError(f"{where}: the key is not valid base64") from None
    if len(raw) != size:
        raise KeyFileError(f"{where}: the key has {len(raw)} bytes, an ed25519 key has {size}")
    return raw


def _read(path: Path, what: str) -> str:
    try:
        return safeio.read_regular(path, MAX_KEY_FILE_BYTES).decode()
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no such {what} file") from None
    except UnicodeDecodeError:
        raise KeyFileError(f"{path}: not a {what} file (not text)") from None
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read the {what} file ({e.strerror})") from None


def private_problem(st: os.stat_result) -> str | None:
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by you"
    if st.st_mode & 0o077:
        return f"readable or writable by others (mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 600` on it"
    return None


def load_signing_key(path: Path) -> SigningKey:
    """The signing key in `path`, refused unless only its owner (us) can read it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no such signing key file (make one: `dsv4 keys generate --out {path}`)") from None
    except OSError as e:
        raise KeyFileError(f"{path}: cannot read the signing key ({e.strerror})") from None
    if problem := private_problem(st):
        raise KeyFileError(f"{path}: refusing the signing key: it is {problem}")
    text = _read(path, "signing key").strip()
    name, sep, body = text.partition(":")
    if not sep or "\n" in text:
        raise KeyFileError(f"{path}: not a signing key (expected one line NAME:BASE64)")
    secret = _b64(body, 64, str(path))
    key = SigningKey(check_name(name), secret[:32])
    if key.public.raw != secret[32:]:
        raise KeyFileError(f"{path}: the public half does not belong to the private key")
    return key


def parse_public_line(line: str, where: str) -> PublicKey:
    parts = line.split()
    if len(parts) not in (2, 3):
        raise KeyFileError(f"{where}: expected `NAME KEY [ID]`, found {len(parts)} fields")
    key = PublicKey(check_name(parts[0]), _b64(parts[1], 32, where))
    if len(parts) == 3 and parts[2] != key.id:
        raise KeyFileError(f"{where}: id {parts[2]} is not the key's own ({key.id})")
    return key


def load_public_key(path: Path) -> PublicKey:
    """The public key of a signing key file or of a one-line public key file (`keys show`)."""
    text = _read(path, "key").strip()
    if ":" in text.partition(" ")[0]:  # NAME:BASE64, a signing key
        return load_signing_key(path).public
    return parse_public_line(text, str(path))


@dataclass(frozen=True)
class TrustedKeys:
    """The public keys whose signatures this host accepts, by id."""

    keys: Mapping[str, PublicKey] = field(default_factory=dict)
    source: str = ""  # where they were read (for error lines)

    def get(self, kid: str) -> PublicKey | None:
        return self.keys.get(kid)

    @classmethod
    def load(cls, path: Path) -> TrustedKeys:
        keys: dict[str, PublicKey] = {}
        for n, line in enumerate(_read(path, "trusted keys").splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                key = parse_public_line(line, f"{path}:{n}")
                keys[key.id] = key
        return cls(keys, str(path))


def env_path(value: Path | str | None, env: str) -> Path | None:
    """A flag's value, else the env variable's, else None."""
    if value:
        return Path(value).expanduser()
    text = os.environ.get(env)
    return Path(text).expanduser() if text else None
