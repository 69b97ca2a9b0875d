"""What a rank posts when it joins the service, and whether every rank agrees with rank 0.

The ranks of one service may run on hosts with their own disks: each holds its own copy of the
checkpoint, with its own mtimes. So the checkpoint is compared by content (store.content_id),
never by the sidecar's key, and a rank that holds other bytes is told which shard differs and
on which host — the two facts an operator needs to fix it. The join is a versioned value both
sides of the store read with this module, never a dict each spells for itself.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from typing import Any

VERSION = 1
ADVICE = "start every rank with the same checkpoint and settings"
SHOWN_SHARDS = 3  # a refusal names this many differing shards, then counts the rest


def plan_parts(plan) -> dict[str, Any]:
    """What must be the same on every rank, by part (the rendezvous names the part that differs):
    the checkpoint by content (never by mtimes: each host may hold its own copy), every
    program's fingerprint, and the launch settings."""
    from store.fingerprint import sha256_hex

    spec = plan.spec
    programs = sha256_hex("\n".join(f"{p.program}={p.fingerprint}" for p in plan.programs))
    return {"checkpoint": plan.content_id.identity, "programs": programs[:16],
            "ranks": spec.ranks, "backend": plan.backend, "device": plan.device, "max_seq": spec.max_seq,
            "max_slots": spec.max_slots, "memory_utilization": spec.memory_utilization,
            "ready": plan.ready, "use_sidecar": spec.use_sidecar}


@dataclass(frozen=True)
class Join:
    """One rank's plan parts (checkpoint identity, programs, settings), its host and what its
    checkpoint's identity is made of (config, weight_map, every shard's name, size, sha256)."""

    parts: dict[str, Any]
    host: str
    config_sha256: str = ""
    weight_map_sha256: str = ""
    shards: tuple[tuple[str, int, str | None], ...] = ()
    v: int = VERSION

    @classmethod
    def of(cls, parts: dict[str, Any], content) -> Join:
        """This rank's join: `content` is its plan's store.content_id.ContentId."""
        return cls(parts, socket.gethostname(), content.config_sha256, content.weight_map_sha256,
                   tuple((s.name, s.size, s.sha256) for s in content.shards))

    def line(self) -> str:
        return json.dumps({"v": self.v, "parts": self.parts, "host": self.host, "config_sha256": self.config_sha256,
                           "weight_map_sha256": self.weight_map_sha256, "shards": [list(s) for s in self.shards]},
                          sort_keys=True)

    @classmethod
    def from_line(cls, text: str) -> Join:
        """A rank's posted join; ValueError for anything that is not a join of this version."""
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("v") != VERSION:
            raise ValueError(f"a join of version {raw.get('v') if isinstance(raw, dict) else None!r}, not {VERSION}")
        shards = tuple((str(n), int(size), sha) for n, size, sha in raw.get("shards", []))
        return cls(dict(raw["parts"]), str(raw.get("host", "")), str(raw.get("config_sha256", "")),
                   str(raw.get("weight_map_sha256", "")), shards)


def _short(sha: str | None) -> str:
    return f"{sha[:8]}…" if sha else "unknown"


def checkpoint_difference(theirs: Join, lead: Join) -> str:
    """What differs between two ranks' checkpoints, by file: the shards (theirs vs rank 0's)."""
    mine, other = {s[0]: s for s in lead.shards}, {s[0]: s for s in theirs.shards}
    lines = []
    for name in sorted(set(mine) | set(other)):
        a, b = other.get(name), mine.get(name)
        if a is None or b is None:
            lines.append(f"shard {name} is {'only in' if a is None else 'missing from'} rank 0's checkpoint")
        elif a[1] != b[1]:
            lines.append(f"shard {name} differs (size {a[1]} vs {b[1]} bytes)")
        elif a[2] != b[2]:
            lines.append(f"shard {name} differs (sha256 {_short(a[2])} vs {_short(b[2])})")
    if theirs.config_sha256 != lead.config_sha256:
        lines.insert(0, f"config.json differs (sha256 {_short(theirs.config_sha256)} vs {_short(lead.config_sha256)})")
    if theirs.weight_map_sha256 != lead.weight_map_sha256:
        lines.insert(0, "the index's weight_map differs")
    if not lines:
        return "their content identities differ"
    more = len(lines) - SHOWN_SHARDS
    return "; ".join(lines[:SHOWN_SHARDS]) + (f"; and {more} more" if more > 0 else "")


def disagreement(posted: list[str]) -> str | None:
    """The first way a rank's join differs from rank 0's, as one line naming both hosts; None
    when every rank agrees. The checkpoint is compared by content, first; then every other part."""
    joins: list[Join] = []
    for r, text in enumerate(posted):
        try:
            joins.append(Join.from_line(text))
        except (ValueError, KeyError, TypeError) as e:
            return f"rendezvous: rank {r} posted {e}; run the same dsv4 version on every rank"
    lead = joins[0]
    for r, theirs in enumerate(joins[1:], start=1):
        who, zero = f"rank {r} on {theirs.host}", f"rank 0 on {lead.host}"
        if theirs.parts.get("checkpoint") != lead.parts.get("checkpoint"):
            return (f"rendezvous: {who} holds a different checkpoint than {zero}: "
                    f"{checkpoint_difference(theirs, lead)}; {ADVICE}")
        for part in sorted(set(lead.parts) | set(theirs.parts)):
            if theirs.parts.get(part) != lead.parts.get(part):
                return (f"rendezvous: {who} differs from {zero} in {part} "
                        f"({theirs.parts.get(part)!r} vs {lead.parts.get(part)!r}); {ADVICE}")
    return None
