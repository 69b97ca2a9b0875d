"""Entries that travel: the bundle value, its signature, and its tar form (written and read).

A bundle is a plain (uncompressed: compiled artifacts barely compress) POSIX tar archive with a
fixed member layout, in this order::

    dsv4-bundle.json                          {"format": 1, "kind": "dsv4-kernel-cache-bundle",
                                               "host": …, "created": …, "entries": [[program, fp], …]}
    <program>/<fingerprint>/signature.json    {"v": 1, "key_id": …, "signer": NAME, "signature": BASE64}
    <program>/<fingerprint>/manifest.json     the entry's manifest (without an origin)
    <program>/<fingerprint>/<artifact>        each artifact file the manifest lists

The signature (ed25519, `store.signing`) is over `signed_message(manifest)`: the entry's
program, its key digest (the fingerprint) and the sha256 of its manifest's canonical JSON, so it
says what the entry *is*; the artifacts are bound through the manifest's sha256s.

Reading is streaming and never trusts the archive: only regular files, named as above (no
absolute path, `..`, link, device, FIFO or directory), each once, the index first, a manifest
before its artifacts, an artifact exactly the size its manifest says, small files capped, and an
archive that ends early (a truncated file, or one cut at a member boundary: every entry the index
lists must be complete) is one problem. `read_bundle` stops at the first such problem and keeps
it in the value (`Bundle.problem`) with what it read before: the importer judges signatures
first, then that problem (`store.kernel_cache.transfer`). The same `Bundle` value comes from a
registry (`store.kernel_cache.oci`) or any other transport.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import socket
import tarfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import IO, Any

from store.errors import UserError
from store.fingerprint import canonical_json, sha256_hex
from store.kernel_cache.entry import (
    ENTRY_NAME,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    Corrupt,
    Manifest,
    check_program_name,
    is_artifact_name,
)  # fmt: skip
from store.signing import SigningKey

BUNDLE_FORMAT = 1
BUNDLE_KIND = "dsv4-kernel-cache-bundle"
INDEX = "dsv4-bundle.json"
SIGNATURE = "signature.json"
SIGNED_DOMAIN = b"dsv4-kernel-cache-entry-v1\n"
MAX_SMALL_BYTES = 64 << 10  # the index and signatures: a few hundred bytes each
MAX_ENTRIES = 4096


class BundleError(UserError):
    """A bundle (file, registry artifact, stream) that is refused: one line, nothing installed."""


@dataclass(frozen=True)
class Signature:
    key_id: str
    signer: str  # the key's name, as the signer called it (informative: the id is what counts)
    signature: bytes = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"v": 1, "key_id": self.key_id, "signer": self.signer,
                "signature": base64.b64encode(self.signature).decode()}

    @classmethod
    def parse(cls, raw: bytes) -> Signature:
        try:
            data = json.loads(raw)
            sig = base64.b64decode(str(data["signature"]), validate=True)
            return cls(str(data["key_id"]), str(data["signer"]), sig)
        except (ValueError, KeyError, TypeError, RecursionError, binascii.Error):
            raise ValueError("malformed signature.json") from None


def signed_message(manifest: Manifest) -> bytes:
    """What an entry's signature is over: program, key digest and manifest digest."""
    digest = sha256_hex(canonical_json(manifest.own_json()))
    body = {"program": manifest.program, "fingerprint": manifest.fingerprint, "manifest_sha256": digest}
    return SIGNED_DOMAIN + canonical_json(body).encode()


@dataclass(frozen=True)
class EntryBundle:
    """One entry on its way: its manifest, its artifacts' bytes, and who signed it."""

    manifest: Manifest
    contents: Mapping[str, bytes] = field(repr=False)
    signature: Signature | None = None
    # where this entry came from, when not its bundle's host and reference (a registry's)
    host: str = ""
    reference: str = ""

    @property
    def name(self) -> str:
        return f"{self.manifest.program}/{self.manifest.fingerprint[:12]}"

    def signed(self, key: SigningKey) -> EntryBundle:
        sig = Signature(key.public.id, key.name, key.sign(signed_message(self.manifest)))
        return replace(self, signature=sig)

    @classmethod
    def of(cls, manifest: Manifest, contents: Mapping[str, bytes]) -> EntryBundle:
        """An entry read from a cache, as it travels: without the origin it had here."""
        return cls(replace(manifest, origin=None), dict(contents))


@dataclass(frozen=True)
class Bundle:
    """Entries from one host. `problem`: the first unsafe thing met while reading (nothing after
    it was read); `reference`: where it was read from, kept in each installed entry's origin."""

    host: str
    created: float
    entries: tuple[EntryBundle, ...]
    reference: str = ""
    problem: str | None = None

    @classmethod
    def of(cls, entries: Iterable[EntryBundle]) -> Bundle:
        return cls(socket.gethostname(), time.time(), tuple(entries))


# ---------------------------------------------------------------------------------------------
# Writing


def write_bundle(out: IO[bytes], bundle: Bundle) -> int:
    """Write `bundle` as a tar to the binary stream `out`; the bytes written."""
    counted = _Counting(out)
    index = {"format": BUNDLE_FORMAT, "kind": BUNDLE_KIND, "host": bundle.host, "created": bundle.created,
             "entries": [[e.manifest.program, e.manifest.fingerprint] for e in bundle.entries]}
    with tarfile.open(fileobj=counted, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, INDEX, json.dumps(index, indent=1).encode(), bundle.created)
        for e in bundle.entries:
            where = f"{e.manifest.program}/{e.manifest.fingerprint}"
            if e.signature is not None:
                _add(tar, f"{where}/{SIGNATURE}", json.dumps(e.signature.to_json()).encode(), bundle.created)
            _add(tar, f"{where}/{MANIFEST}", json.dumps(e.manifest.to_json(), indent=1, sort_keys=True).encode(),
                 bundle.created)
            for f in e.manifest.files:
                _add(tar, f"{where}/{f.name}", e.contents[f.name], bundle.created)
    return counted.written


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, int(mtime)
    tar.addfile(info, io.BytesIO(data))


class _Counting(io.RawIOBase):
    def __init__(self, out: IO[bytes]):
        self.out, self.written = out, 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.out.write(b)
        self.written += len(b)
        return len(b)


# ---------------------------------------------------------------------------------------------
# Reading


_KINDS = ((tarfile.TarInfo.issym, "a symlink"), (tarfile.TarInfo.islnk, "a hard link"),
          (tarfile.TarInfo.isdir, "a directory"), (tarfile.TarInfo.ischr, "a character device"),
          (tarfile.TarInfo.isblk, "a block device"), (tarfile.TarInfo.isfifo, "a FIFO"))


def _name_problem(m: tarfile.TarInfo) -> str | None:
    if not m.isreg():
        what = next((w for test, w in _KINDS if test(m)), "not a regular file")
        return f"member {m.name!r} is {what}; a bundle holds regular files only"
    if m.name.startswith("/"):
        return f"member {m.name!r} has an absolute path"
    parts = m.name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return f"member {m.name!r} has a '..', '.' or empty path component"
    if m.name == INDEX:
        return None
    if len(parts) != 3 or ENTRY_NAME.fullmatch(parts[1]) is None:
        return f"member {m.name!r} is not <program>/<fingerprint>/<file>"
    try:
        check_program_name(parts[0])
    except ValueError:
        return f"member {m.name!r}: invalid program name"
    if parts[2] not in (SIGNATURE, MANIFEST) and not is_artifact_name(parts[2]):
        return f"member {m.name!r}: invalid file name"
    return None


class _Reading:
    """The state of one streaming read (what `read_bundle` fills in, member by member)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.total = max_bytes, 0
        self.index: dict[str, Any] | None = None
        self.listed: list[tuple[str, str]] = []
        self.seen: set[str] = set()
        self.manifests: dict[tuple[str, str], Manifest] = {}
        self.signatures: dict[tuple[str, str], Signature] = {}
        self.contents: dict[tuple[str, str], dict[str, bytes]] = {}

    def member(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> str | None:
        """Read one member; the problem that stops reading, or None."""
        if problem := _name_problem(m):
            return problem
        if m.name in self.seen:
            return f"member {m.name!r} appears twice"
        self.seen.add(m.name)
        self.total += m.size
        if self.total > self.max_bytes:
            return f"the bundle holds more than {self.max_bytes} bytes (the cap)"
        if m.name == INDEX:
            return self._index(_data(tar, m, MAX_SMALL_BYTES))
        if self.index is None:
            return f"member {m.name!r} comes before {INDEX}"
        program, fp, name = m.name.split("/")
        slot = (program, fp)
        if slot not in self.listed:
            return f"member {m.name!r} is of an entry the index does not list"
        if name == SIGNATURE:
            try:
                self.signatures[slot] = Signature.parse(_data(tar, m, MAX_SMALL_BYTES))
            except ValueError as e:
                return f"{program}/{fp[:12]}: {e}"
            return None
        if name == MANIFEST:
            try:
                self.manifests[slot] = Manifest.parse(_data(tar, m, MAX_MANIFEST_BYTES), program, fp)
            except Corrupt as e:
                return f"{program}/{fp[:12]}: {e}"
            self.contents[slot] = {}
            return None
        manifest = self.manifests.get(slot)
        if manifest is None:
            return f"member {m.name!r} comes before its entry's {MANIFEST}"
        sizes = {f.name: f.size for f in manifest.files}
        if name not in sizes:
            return f"member {m.name!r} is not an artifact its manifest lists"
        if m.size != sizes[name]:  # refused before a byte of it is read
            return f"{program}/{fp[:12]}: {name} has {m.size} bytes in the bundle, its manifest says {sizes[name]}"
        self.contents[slot][name] = _data(tar, m, sizes[name])
        return None

    def _index(self, raw: bytes) -> str | None:
        try:
            data = json.loads(raw)
            if data["kind"] != BUNDLE_KIND or int(data["format"]) != BUNDLE_FORMAT:
                return f"{INDEX}: not a dsv4 bundle of format {BUNDLE_FORMAT}"
            listed = [(str(p), str(fp)) for p, fp in data["entries"]]
            str(data["host"]), float(data["created"])
        except (ValueError, KeyError, TypeError, RecursionError):
            return f"{INDEX}: malformed"
        if len(listed) > MAX_ENTRIES:
            return f"{INDEX}: lists {len(listed)} entries, more than {MAX_ENTRIES}"
        self.index, self.listed = data, listed
        return None

    def bundle(self, reference: str, problem: str | None) -> Bundle:
        entries = []
        for slot in self.listed:
            manifest = self.manifests.get(slot)
            complete = manifest is not None and len(self.contents[slot]) == len(manifest.files)
            if not complete and problem is None:
                problem = f"the bundle ends before {slot[0]}/{slot[1][:12]} is complete (truncated)"
            if manifest is not None:
                entries.append(EntryBundle(manifest, self.contents[slot], self.signatures.get(slot)))
        if self.index is None and problem is None:
            problem = f"no {INDEX}: not a dsv4 bundle"
        host = str(self.index["host"]) if self.index else ""
        created = float(self.index["created"]) if self.index else 0.0
        return Bundle(host, created, tuple(entries), reference, problem)


def _data(tar: tarfile.TarFile, m: tarfile.TarInfo, cap: int) -> bytes:
    if m.size > cap:
        raise _TooLarge(f"member {m.name!r} has {m.size} bytes, more than its cap ({cap})")
    f = tar.extractfile(m)
    data = f.read() if f is not None else b""
    if len(data) != m.size:
        raise EOFError("unexpected end of data")
    return data


class _TooLarge(Exception):
    pass


def read_bundle(stream: IO[bytes], reference: str, *, max_bytes: int = 64 << 30) -> Bundle:
    """The bundle in the tar stream `stream` (read once, front to back, never seeking)."""
    reading = _Reading(max_bytes)
    problem = None
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for m in tar:
                if problem := reading.member(tar, m):
                    break
    except _TooLarge as e:
        problem = str(e)
    except (tarfile.TarError, EOFError) as e:
        problem = f"not a complete tar archive (truncated or damaged: {e})"
    return reading.bundle(reference, problem)
