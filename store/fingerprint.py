"""Cache keys as data: an ordered list of named components, and the one fingerprint function.

A key is printable and diffable: "why did this miss?" is answered by the key itself. Every
cache in this project (programs, sidecars) asks `fingerprint()`; nothing else hashes keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# A component whose value could not be determined. A key holding it never stores, never hits.
UNKNOWN = "<unknown>"


def canonical_json(value: Any) -> str:
    """The one serialisation that is hashed: sorted keys, no whitespace, UTF-8 kept."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_hex(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Key:
    """An ordered tuple of (name, JSON value) components."""

    components: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, items: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Key:
        pairs = tuple(items.items()) if isinstance(items, Mapping) else tuple(items)
        names = [n for n, _ in pairs]
        if len(names) != len(set(names)):
            raise ValueError(f"duplicate key component names: {names}")
        # Round-trip through JSON so the stored and the live key compare equal (tuples → lists).
        return cls(tuple((n, json.loads(canonical_json(v))) for n, v in pairs))

    def to_json(self) -> list[list[Any]]:
        return [[n, v] for n, v in self.components]

    @classmethod
    def from_json(cls, data: Any) -> Key:
        if not isinstance(data, list) or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in data
        ):
            raise ValueError("key must be a list of [name, value] pairs")
        return cls.of((p[0], p[1]) for p in data)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.components)

    def unknown_components(self) -> list[str]:
        return [n for n, v in self.components if _holds_unknown(v)]

    @property
    def storable(self) -> bool:
        return not self.unknown_components()


def _holds_unknown(value: Any) -> bool:
    if value == UNKNOWN:
        return True
    if isinstance(value, dict):
        return any(_holds_unknown(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_unknown(v) for v in value)
    return False


def fingerprint(key: Key) -> str:
    """sha256 of the key's canonical JSON: the only place a key becomes a hash."""
    return sha256_hex(canonical_json(key.to_json()))


def _short(value: Any, limit: int = 40) -> str:
    text = value if isinstance(value, str) else canonical_json(value)
    return text if len(text) <= limit else text[: limit - 9] + "…" + sha256_hex(text)[:8]


@dataclass(frozen=True)
class Change:
    """One component that differs between a stored key (`old`: what the entry or file was made
    with, "here") and the live one (`new`: what this launch uses)."""

    component: str
    old: Any
    new: Any

    def __str__(self) -> str:
        """The fact as a sentence naming the component and both values: `max_seq is 512 here;
        this launch uses 1024` (a structured component: each differing fact, not two blobs)."""
        if self.old is _ABSENT:
            return f"{self.component} is absent here; this launch uses {_short(self.new)}"
        if self.new is _ABSENT:
            return f"{self.component} is {_short(self.old)} here; this launch has none"
        if isinstance(self.old, dict) and isinstance(self.new, dict):
            leaves = list(_leaves("", self.old, self.new))
            shown = ". ".join(f"{self.component}'s {path} is {_short(a)} here; this launch uses {_short(b)}"
                              for path, a, b in leaves[:MAX_LEAVES])
            return shown + (f" (and {len(leaves) - MAX_LEAVES} more)" if len(leaves) > MAX_LEAVES else "")
        return f"{self.component} is {_short(self.old)} here; this launch uses {_short(self.new)}"

    def raw(self) -> str:
        """The difference as the keys hold it (`old → new`, each value in canonical JSON, whole):
        what a details view shows under the sentence."""
        def text(v: Any) -> str:
            return "(absent)" if v is _ABSENT else canonical_json(v)

        return f"{text(self.old)} → {text(self.new)}"


MAX_LEAVES = 3


def _leaves(path: str, old: Any, new: Any) -> Iterable[tuple[str, Any, Any]]:
    """The innermost values that differ between two structured values, by dotted path."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            a, b = old.get(k, "-"), new.get(k, "-")
            if a != b:
                yield from _leaves(f"{path}.{k}" if path else str(k), a, b)
    else:
        yield path, old, new


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT: Any = _Absent()


def diff(old: Key, new: Key) -> list[Change]:
    """The components that differ between two keys, in the new key's order."""
    a, b = old.as_dict(), new.as_dict()
    changes = [Change(n, a.get(n, _ABSENT), v) for n, v in new.components if a.get(n, _ABSENT) != v]
    changes += [Change(n, v, _ABSENT) for n, v in old.components if n not in b]
    return changes


def describe(changes: list[Change]) -> str:
    """Every change as its sentence (see `Change.__str__`), one after the other."""
    return ". ".join(str(c) for c in changes) if changes else "no component differs"


def raw_difference(changes: list[Change]) -> dict[str, str]:
    """Every change as the keys hold it, by component (for a details view)."""
    return {c.component: c.raw() for c in changes}
