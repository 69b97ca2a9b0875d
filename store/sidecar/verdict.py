"""Verdicts: MAP the sidecar, or REPACK from the checkpoint — and why — with the cold policy.

`inspect` judges without mapping (no torch): the console and `dsv4 sidecar status` use it, and
the launch plan calls it with the LIVE source key and the packed layout's tensors.
`expected_key=None` judges a sidecar on its own: the key is recomputed from the checkpoint dir
and the settings the sidecar records. Checks run cheapest and most decisive first; nothing a
file contains makes them raise.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from store import pagecache, safeio
from store.errors import UserError
from store.fingerprint import Key, diff, fingerprint
from store.sidecar.format import CorruptSidecar, Header, TensorShape, sound_header
from store.sidecar.key import change_text, recompute_key
from store.units import format_size

log = logging.getLogger("store.sidecar")

class Action(StrEnum):
    """What a launch does with its sidecar."""

    MAP = "MAP"  # map it: the packed weights are its pages
    REPACK = "REPACK"  # pack from the checkpoint instead (the reason says why)


class Reason(StrEnum):
    """Why a launch repacks: the only words a REPACK verdict says it with."""

    MISSING = "missing"  # no sidecar at the path
    STALE = "stale"  # packed from a checkpoint, packer or layout that has changed since (never usable again)
    COLD = "cold"  # valid, but not in the page cache, and the cold policy says repack
    CORRUPT = "corrupt"  # unreadable, unsound, or changed while being loaded
    NAMES = "names"  # another tensor set than the packed layout's
    SHAPES = "shapes"  # the layout's tensors with other dtypes or shapes
    SOURCE = "source"  # the checkpoint it was packed from cannot be read (says nothing about the file)
    DISABLED = "disabled"  # --no-sidecar


MAP, REPACK = Action.MAP, Action.REPACK
REASONS = tuple(Reason)
COLD_POLICIES = ("reject", "read", "auto")
DEFAULT_COLD_THRESHOLD = 0.9


@dataclass(frozen=True)
class Verdict:
    """MAP the sidecar, or REPACK from the checkpoint — and why, in data and in one sentence."""

    action: Action
    reason: Reason | str  # "" for MAP
    detail: str
    path: str
    residency: float | None = None
    residency_method: str | None = None
    size_bytes: int = 0
    tensors: int = 0
    created: float | None = None
    pack_seconds: float | None = None
    changes: tuple[str, ...] = ()  # stale: each changed key component, "old → new"
    cold_read: bool = False  # MAP of a cold file: expect a read of the uncached bytes
    predicted_read_s: float | None = None
    predicted_pack_s: float | None = None
    read_bytes_per_s: float | None = None

    @property
    def mapped(self) -> bool:
        return self.action == MAP

    def line(self) -> str:
        """The one log line of this verdict."""
        head = f"sidecar {self.path}: {self.action}"
        return f"{head} ({self.reason}): {self.detail}" if self.reason else f"{head}: {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "verdict": self.action,
            "reason": self.reason,
            "detail": self.detail,
            "residency": self.residency,
            "residency_method": self.residency_method,
            "size_bytes": self.size_bytes,
            "tensors": self.tensors,
            "created": self.created,
            "age_seconds": None if self.created is None else max(0.0, time.time() - self.created),
            "pack_seconds": self.pack_seconds,
            "changes": list(self.changes),
            "cold_read": self.cold_read,
            "predicted_read_s": self.predicted_read_s,
            "predicted_pack_s": self.predicted_pack_s,
            "read_bytes_per_s": self.read_bytes_per_s,
        }


def repack(path: Path, reason: Reason, detail: str, **kw: Any) -> Verdict:
    return Verdict(REPACK, reason, detail, str(path), **kw)


def _names_detail(absent: set[str], extra: set[str]) -> str:
    def some(names: set[str]) -> str:
        shown = sorted(names)[:3]
        return ", ".join(shown) + (f", … ({len(names) - 3} more)" if len(names) > 3 else "")

    parts = []
    if absent:
        parts.append(f"{len(absent)} missing ({some(absent)})")
    if extra:
        parts.append(f"{len(extra)} extra ({some(extra)})")
    return "tensor names differ from the packed layout: " + "; ".join(parts)


def _shape_detail(header: Header, shapes: dict[str, TensorShape]) -> str:
    """'' when every tensor the layout names has its dtype and shape; else the first few."""
    bad = [
        f"{e.name} is {e.dtype}{list(e.shape)}, the layout says {p.dtype}{list(p.shape)}"
        for e in header.entries
        if (p := shapes.get(e.name)) is not None and (e.dtype, e.shape) != (p.dtype, p.shape)
    ]
    if not bad:
        return ""
    more = f"; … ({len(bad) - 2} more)" if len(bad) > 2 else ""
    return "tensors differ from the packed layout: " + "; ".join(bad[:2]) + more


def judge(
    fd: int,
    path: Path,
    *,
    expected_key: Key | None,
    expected_names: Collection[str] | None,
    expected_tensors: Iterable[TensorShape] | None = None,
    cold_threshold: float,
    cold_policy: str,
    residency_method: str | None,
) -> tuple[Verdict, Header | None]:
    """The verdict on the open file `fd` and its header (when sound). Never raises for
    anything the file contains. Checks run cheapest and most decisive first."""
    size = os.fstat(fd).st_size
    facts: dict[str, Any] = {"size_bytes": size}
    # Probed before the header read pulls its first pages in, and reported with every verdict.
    try:
        res: pagecache.Residency | None = pagecache.residency(fd, method=residency_method)
        facts.update(residency=res.fraction, residency_method=res.method)
    except OSError as e:
        log.debug("residency probe of %s failed: %s", path, e)
        res = None
    try:
        header, stored, created, pack_seconds = sound_header(fd, size)
    except CorruptSidecar as e:
        return repack(path, Reason.CORRUPT, str(e), **facts), None
    facts.update(tensors=len(header.entries), created=created, pack_seconds=pack_seconds)

    if expected_key is None:
        try:
            expected_key = recompute_key(stored, header.metadata, path)
        except UserError as e:
            # the checkpoint is unreadable: that says nothing about this file, so not "stale"
            return repack(path, Reason.SOURCE, f"source checkpoint unreadable: {e}", **facts), header
    if fingerprint(expected_key) != header.metadata["source_fingerprint"]:
        changes = tuple(change_text(c) for c in diff(stored, expected_key))
        detail = "changed: " + ". ".join(changes)
        return repack(path, Reason.STALE, detail, changes=changes, **facts), header
    shapes = {p.name: p for p in expected_tensors} if expected_tensors is not None else None
    if expected_names is None and shapes is not None:
        expected_names = set(shapes)
    if expected_names is not None:
        absent, extra = set(expected_names) - header.names, header.names - set(expected_names)
        if absent or extra:
            return repack(path, Reason.NAMES, _names_detail(absent, extra), **facts), header
    differ = _shape_detail(header, shapes) if shapes is not None else ""
    if differ:
        return repack(path, Reason.SHAPES, differ, **facts), header
    return residency_verdict(path, res, cold_threshold, cold_policy, facts), header


def residency_verdict(
    path: Path,
    res: pagecache.Residency | None,
    cold_threshold: float,
    cold_policy: str,
    facts: dict[str, Any],
) -> Verdict:
    """A sound, current sidecar: MAP when hot; when cold, what the cold policy says."""
    if res is None:
        return Verdict(MAP, "", "valid; residency unknown", str(path), **facts)
    pct = f"{res.fraction:.0%} resident"
    if res.fraction >= cold_threshold:
        return Verdict(MAP, "", f"valid and hot ({pct})", str(path), **facts)
    below = f"{pct} < {cold_threshold:.0%} threshold"
    if cold_policy == "reject":
        return repack(path, Reason.COLD, f"{below}; cold policy reject", **facts)
    if cold_policy == "read":
        detail = f"{below}; cold policy read: mapping and reading it"
        return Verdict(MAP, "", detail, str(path), cold_read=True, **facts)
    tp = pagecache.read_throughput()
    pack_s = facts["pack_seconds"]
    cold_bytes = max(0, facts["size_bytes"] - res.cached_bytes)
    read_s = cold_bytes / tp.bytes_per_s
    source = "measured on this host" if tp.measured else "default; `dsv4 sidecar warm` measures"
    why = (
        f"reading {format_size(cold_bytes)} at {format_size(tp.bytes_per_s)}/s ({source}) "
        f"≈ {read_s:.1f} s vs repacking ≈ {pack_s:.1f} s"
    )
    facts = {**facts, "predicted_read_s": read_s, "predicted_pack_s": pack_s}
    facts["read_bytes_per_s"] = tp.bytes_per_s
    if read_s <= pack_s:
        detail = f"{below}; cold policy auto reads it: {why}"
        return Verdict(MAP, "", detail, str(path), cold_read=True, **facts)
    return repack(path, Reason.COLD, f"{below}; cold policy auto repacks: {why}", **facts)


MISSING_DETAIL = "no sidecar at this path; prepack to create it"


def missing(path: Path | str, detail: str = MISSING_DETAIL) -> Verdict:
    """The verdict on a sidecar that does not exist (one shape for every caller)."""
    return repack(Path(path), Reason.MISSING, detail)


def open_checked(path: Path) -> int | Verdict:
    """A read-only fd on the sidecar, or the REPACK verdict saying why there is none.

    Never blocks: a FIFO, device, socket or directory at the path is "corrupt: not a regular
    file (a FIFO)", like any other unreadable input.
    """
    try:
        return safeio.open_regular(path)
    except FileNotFoundError:
        return missing(path)
    except OSError as e:
        return repack(path, Reason.CORRUPT, f"cannot open ({e.strerror}); check the file")


def check_args(cold_threshold: float, cold_policy: str) -> None:
    if cold_policy not in COLD_POLICIES:
        raise ValueError(f"cold_policy must be one of {COLD_POLICIES}, got {cold_policy!r}")
    if not 0.0 <= cold_threshold <= 1.0:
        raise ValueError(f"cold_threshold must be within 0..1, got {cold_threshold}")


def inspect(
    path: Path | str,
    *,
    expected_key: Key | None = None,
    expected_names: Collection[str] | None = None,
    expected_tensors: Iterable[TensorShape] | None = None,
    cold_threshold: float = DEFAULT_COLD_THRESHOLD,
    cold_policy: str = "auto",
    residency_method: str | None = None,
) -> Verdict:
    """The verdict on a sidecar without mapping it (no torch). Logged at debug level only:
    this is a query; the loading path (`open_sidecar`) is what logs decisions.

    `expected_key=None` judges staleness against the checkpoint the sidecar records.
    `expected_tensors` (the expected TensorShapes) also checks every tensor's dtype and shape and
    implies `expected_names` when that is not given.
    """
    check_args(cold_threshold, cold_policy)
    path = Path(path)
    opened = open_checked(path)
    if isinstance(opened, Verdict):
        return opened
    try:
        verdict, _ = judge(
            opened, path, expected_key=expected_key, expected_names=expected_names,
            expected_tensors=expected_tensors,
            cold_threshold=cold_threshold, cold_policy=cold_policy,
            residency_method=residency_method,
        )  # fmt: skip
    finally:
        os.close(opened)
    log.debug("%s", verdict.line())
    return verdict

