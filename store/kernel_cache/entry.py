"""Kernel cache entries as data: the manifest, lookup results, inventory lines and their
states, and the judgement of an entry (or of a missing one) against what the caller knows.

Nothing here touches the disk: `Manifest.parse` parses bytes the caller read, `closest_miss`
judges manifests the caller listed.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from store.fingerprint import UNKNOWN, Change, Key, describe, diff, fingerprint
from store.units import format_age

FORMAT_VERSION = 1
VERSION_DIR = f"v{FORMAT_VERSION}"
MANIFEST = "manifest.json"
HITS = ".hits"
QUARANTINE = "quarantine"
QUARANTINE_NOTE = "quarantine.json"
TRASH = ".trash"
LOCKS = ".locks"
# A manifest holds a key and a few file names: kilobytes. Past this it is corrupt, not read.
MAX_MANIFEST_BYTES = 1 << 20
MAX_QUARANTINE_NOTE_BYTES = 64 << 10


class EntryState(StrEnum):
    """The state of an inventory line (its string value is what `ls --json` prints)."""

    CURRENT = "current"
    OTHER_LAYOUT = "other-layout"
    STALE = "stale"
    CORRUPT = "corrupt"
    PARTIAL = "partial"
    QUARANTINED = "quarantined"  # moved aside after a failed read/verify/load: garbage, like corrupt


CURRENT = EntryState.CURRENT
OTHER_LAYOUT = EntryState.OTHER_LAYOUT
STALE = EntryState.STALE
CORRUPT = EntryState.CORRUPT
PARTIAL = EntryState.PARTIAL
QUARANTINED = EntryState.QUARANTINED
STATES = tuple(EntryState)

# The names this project gives the things it creates: only these are ever deleted or moved.
ENTRY_NAME = re.compile(r"[0-9a-f]{64}")
QUARANTINE_NAME = re.compile(r"(?P<program>[^/]+)--(?P<fp>[0-9a-f]{16})--\d+--[0-9a-f]{8}")
TRASH_NAME = re.compile(r"(?:[0-9a-f]{64}|\.tmp-[0-9a-f]{16}\..+\.\d+\.[0-9a-f]{8})\.[0-9a-f]{8}")


class Corrupt(Exception):
    """An entry that cannot be read or verified (becomes a MISS + quarantine)."""

    kind = "corrupt"  # the Miss kind it becomes
    # (dev, ino) of the entry dir actually read, when known: only that dir may be quarantined
    dir_id: tuple[int, int] | None = None


class Untrusted(Corrupt):
    """An entry whose files could have been written by someone else."""

    kind = "untrusted"


# ---------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True)
class ArtifactFile:
    name: str
    sha256: str
    size: int


@dataclass(frozen=True)
class Origin:
    """Where an entry brought from elsewhere came from (absent: built on this host)."""

    host: str  # the host that exported or pushed it
    signer: str  # the signer's key id (store.signing.key_id)
    reference: str  # the bundle file or registry reference it was read from
    time: float  # when it was installed here

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "signer": self.signer, "reference": self.reference, "time": self.time}

    @classmethod
    def parse(cls, data: Any) -> Origin:
        return cls(str(data["host"]), str(data["signer"]), str(data["reference"]), float(data["time"]))

    def __str__(self) -> str:
        return f"from {self.host}, signed by {self.signer}"

    def short(self, now: float) -> str:
        """All of it in a table cell: host, signer, the reference shortened (a bundle file's name,
        a registry digest's first 12 hex digits) and how long ago it was installed."""
        ref = self.reference
        if "@sha256:" in ref:
            head, _, digest = ref.partition("@sha256:")
            ref = f"{head}@sha256:{digest[:12]}"
        elif ref.startswith("/"):
            ref = Path(ref).name
        return f"{self}, {ref} ({format_age(now - self.time)} ago)"


@dataclass(frozen=True)
class Manifest:
    program: str
    fingerprint: str
    key: Key
    config_components: tuple[str, ...]
    files: tuple[ArtifactFile, ...]
    compile_seconds: float
    created: float
    host: str
    pid: int
    format: int = FORMAT_VERSION
    compile_peak_rss: int = 0  # bytes: the compiling process's peak RSS (what a pool plans memory by)
    origin: Origin | None = None  # set when the entry was brought from another host

    def to_json(self) -> dict[str, Any]:
        """The manifest as stored; `origin` only when there is one (older manifests lack it)."""
        out = self.own_json()
        if self.origin is not None:
            out["origin"] = self.origin.to_json()
        return out

    def own_json(self) -> dict[str, Any]:
        """What the entry is, wherever it lies: everything but its origin (what is signed)."""
        return {
            "format": self.format,
            "program": self.program,
            "fingerprint": self.fingerprint,
            "key": self.key.to_json(),
            "config_components": list(self.config_components),
            "files": [{"name": f.name, "sha256": f.sha256, "size": f.size} for f in self.files],
            "compile_seconds": self.compile_seconds,
            "created": self.created,
            "host": self.host,
            "pid": self.pid,
            "compile_peak_rss": self.compile_peak_rss,
        }

    @classmethod
    def parse(cls, raw: bytes, program: str, fp: str) -> Manifest:
        """Parse and check a manifest read from `<program>/<fp>/`; raise Corrupt on any flaw."""
        try:
            data = json.loads(raw)
            if not isinstance(data["program"], str) or not isinstance(data["fingerprint"], str):
                raise TypeError("program and fingerprint must be strings")
            m = cls(
                program=data["program"],
                fingerprint=data["fingerprint"],
                key=key_from_json(data["key"]),
                config_components=tuple(str(n) for n in data["config_components"]),
                files=tuple(
                    ArtifactFile(str(f["name"]), str(f["sha256"]), int(f["size"]))
                    for f in data["files"]
                ),
                compile_seconds=float(data["compile_seconds"]),
                created=float(data["created"]),
                host=str(data["host"]),
                pid=int(data["pid"]),
                format=int(data["format"]),
                compile_peak_rss=int(data.get("compile_peak_rss", 0)),
                origin=Origin.parse(data["origin"]) if data.get("origin") is not None else None,
            )
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise Corrupt(f"malformed manifest ({type(e).__name__}: {e})") from None
        if m.format != FORMAT_VERSION:
            raise Corrupt(f"manifest format {m.format}, expected {FORMAT_VERSION}")
        if (m.program, m.fingerprint) != (program, fp):
            raise Corrupt(f"manifest names {m.program}/{m.fingerprint[:12]}, not its own slot")
        if fingerprint(m.key) != fp:
            raise Corrupt("manifest key does not hash to the entry's fingerprint")
        bad = [f.name for f in m.files if not is_artifact_name(f.name)]
        if bad or not m.files:
            raise Corrupt(f"manifest lists invalid artifact names {bad}")
        return m


def key_from_json(data: Any) -> Key:
    # Key.from_json re-canonicalises every value through JSON; values parsed from JSON already
    # are canonical, and skipping that halves the time `ls` takes over a large cache.
    if not isinstance(data, list) or not all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in data
    ):
        raise ValueError("key must be a list of [name, value] pairs")
    if len({p[0] for p in data}) != len(data):
        raise ValueError("duplicate key component names")
    return Key(tuple((p[0], p[1]) for p in data))


@dataclass(frozen=True)
class Hit:
    """A verified entry. `data(name)` returns the exact bytes whose sha256 was checked."""

    program: str
    fingerprint: str
    path: Path | None  # None: built by this process but not published (lost a race, unstorable)
    manifest: Manifest
    contents: Mapping[str, bytes] = field(repr=False)
    hit = True

    def data(self, name: str) -> bytes:
        return self.contents[name]


@dataclass(frozen=True)
class Miss:
    """Why a lookup did not hit: kind is absent | stale | corrupt | unknown | untrusted."""

    program: str
    fingerprint: str
    kind: str
    reason: str
    changes: tuple[Change, ...] = ()
    hit = False


@dataclass(frozen=True)
class Fetch:
    """Result of `get_or_build`: the verified entry, whether this call compiled it, first MISS."""

    hit: Hit
    built: bool
    miss: Miss | None


@dataclass(frozen=True)
class Reference:
    """What the caller knows about the current environment (see the module docstring)."""

    components: Mapping[str, Any] = field(default_factory=dict)
    keys: Mapping[str, Key] = field(default_factory=dict)

    @functools.cached_property
    def fingerprints(self) -> dict[str, str]:
        return {program: fingerprint(key) for program, key in self.keys.items()}


@dataclass(frozen=True)
class Entry:
    """One line of the inventory."""

    program: str
    fingerprint: str
    state: EntryState
    reason: str
    size_bytes: int
    created: float
    last_used: float
    hits: int
    path: Path
    busy: bool = False  # a partial entry whose writer may still be running
    origin: Origin | None = None  # where a brought entry came from

    def to_json(self) -> dict[str, Any]:
        return {
            "program": self.program,
            "fingerprint": self.fingerprint,
            "state": str(self.state),
            "reason": self.reason,
            "size_bytes": self.size_bytes,
            "created": self.created,
            "last_used": self.last_used,
            "hits": self.hits,
            "path": str(self.path),
            "busy": self.busy,
            "origin": self.origin.to_json() if self.origin else None,
        }


@dataclass(frozen=True)
class Verification:
    """Result of `verify`: how many entries were hashed, which were quarantined."""

    checked: int
    quarantined: tuple[Entry, ...]


# ---------------------------------------------------------------------------------------------
# Names and judgement


def is_artifact_name(name: str) -> bool:
    return bool(name) and "/" not in name and not name.startswith(".") and name != MANIFEST


def check_program_name(program: str) -> str:
    if not program or program.startswith(".") or "/" in program or "\0" in program:
        raise ValueError(f"invalid program name {program!r}")
    return program


def judge(manifest: Manifest, reference: Reference) -> tuple[EntryState, str]:
    """(state, reason) of a readable entry against what the caller knows now."""
    live = reference.keys.get(manifest.program)
    if live is not None and reference.fingerprints[manifest.program] == manifest.fingerprint:
        return CURRENT, ""
    if live is not None:
        changes = [c for c in diff(manifest.key, live) if c.new != UNKNOWN]
        present = live.as_dict()
    else:
        old = manifest.key.as_dict()
        changes = [
            Change(n, old[n], v)
            for n, v in reference.components.items()
            if n in old and v != UNKNOWN and old[n] != v
        ]
        present = reference.components
    build = build_changes(changes, manifest, present)
    if build:
        return STALE, describe(build)
    if live is None:
        return CURRENT, "toolchain matches; no live key for source/layout"
    return OTHER_LAYOUT, describe(changes)


def build_changes(
    changes: Iterable[Change], manifest: Manifest, present: Collection[str]
) -> list[Change]:
    """Changes that make an entry unusable forever: a non-configuration component that both
    sides have, with another value (toolchain or source). `present`: the other side's names."""
    old = manifest.key.as_dict()
    config = set(manifest.config_components)
    return [c for c in changes if c.component in old and c.component in present and c.component not in config]


def closest_miss(program: str, key: Key, fp: str, manifests: Iterable[Manifest]) -> Miss:
    """The MISS of a key that has no entry, judged against the program's closest entry (fewest
    differing components, then newest): `stale` when that one differs in a component that
    makes it unusable forever (the reason names it), `absent` otherwise."""
    best: tuple[int, float, Manifest] | None = None
    for m in manifests:
        rank = (len(diff(m.key, key)), -m.created)
        if best is None or rank < best[:2]:
            best = (*rank, m)
    if best is None:
        return Miss(program, fp, "absent", "not cached")
    closest = best[2]
    changes = tuple(diff(closest.key, key))
    build = build_changes(changes, closest, key.as_dict())
    kind = "stale" if build else "absent"
    what = "stale" if build else "not cached for this configuration"
    reason = f"{what}: {describe(list(build or changes))} (closest entry {closest.fingerprint[:12]})"
    return Miss(program, fp, kind, reason, changes)
