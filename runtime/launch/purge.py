"""What a purge may delete: exactly what the plan of *this* checkpoint calls stale or corrupt, or,
over the whole kernel cache, what can never be used again.

- `plan` scope (`dsv4 sidecar purge`, `dsv4 cache purge --stale|--corrupt --model`, the console's
  `x`): program entries of this model's programs that its live keys judge stale (built by another
  toolchain or from other source) or corrupt, and the sidecar only when its verdict against the
  live source key is REPACK because it is stale, corrupt or holds other tensors — never when it
  would MAP, is merely cold, or its checkpoint cannot be read (that says nothing about the file).
  Entries of other programs, other configurations (`other-layout`) and current ones are never
  touched.
- `cache` scope (`x` in the console's kernel-cache view): every entry under the root, judged
  against the plan's live keys and the toolchain, that is stale, corrupt, quarantined, or an
  abandoned staging dir (`purgeable`). Current entries and entries of another layout (another
  `--max-seq`, rank count, MTP on or off) are never touched: another launch may use them.

Each purge looks again right before it deletes, and deletes only what a fresh look still allows.
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from store.errors import UserError
from store.kernel_cache import inventory as inv
from store.sidecar.verdict import REPACK, Reason

SIDECAR_PURGE_REASONS = (Reason.STALE, Reason.CORRUPT, Reason.NAMES)
PLAN, CACHE = "plan", "cache"


@dataclass(frozen=True)
class Target:
    kind: str  # program | sidecar
    path: str
    reason: str  # why it may go
    size_bytes: int
    program: str = ""
    fingerprint: str = ""

    def line(self) -> str:
        what = f"{self.program}/{self.fingerprint[:12]}" if self.kind == "program" else self.path
        return f"{self.kind} {what}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Target:
        """`to_json`'s inverse (what `dsv4 purge --json` printed on a host)."""
        return cls(kind=str(raw["kind"]), path=str(raw["path"]), reason=str(raw.get("reason") or ""),
                   size_bytes=int(raw.get("size_bytes") or 0), program=str(raw.get("program") or ""),
                   fingerprint=str(raw.get("fingerprint") or ""))


def purgeable(entry) -> bool:
    """An entry that can never be used again (the `cache` scope's rule): stale, corrupt,
    quarantined, or a staging dir whose writer is gone."""
    from store.kernel_cache import CORRUPT, PARTIAL, QUARANTINED, STALE

    return not entry.busy and entry.state in (STALE, CORRUPT, QUARANTINED, PARTIAL)


def cache_of(plan):
    from store.kernel_cache import KernelCache
    from store.paths import kernel_cache_dir

    return plan.cache if plan.cache is not None else KernelCache(kernel_cache_dir(plan.spec.kernel_cache_dir))


def inventory(plan) -> list:
    """Every entry under the plan's kernel cache root, judged against its live keys and this
    toolchain; [] when the root does not exist yet."""
    from runtime.programs.build import reference

    cache = cache_of(plan)
    if not cache.root.is_dir():
        return []
    return inv.inventory(cache.layout, reference(plan.device, plan.keys))


def program_targets(plan) -> list[Target]:
    from store.kernel_cache import CORRUPT, QUARANTINED, STALE

    if not plan.keys:
        return []
    # the inventory hashes nothing; the plan verified each entry it would load: an artifact whose
    # sha256 differs is CORRUPT there, and purgeable, even though its listing looks current
    corrupt = {p.entry: p.reason for p in plan.programs if p.state == "CORRUPT" and p.entry}
    return [_target(e, corrupt.get(str(e.path))) for e in inventory(plan)
            if e.program in plan.keys and not e.busy
            and (e.state in (STALE, CORRUPT, QUARANTINED) or str(e.path) in corrupt)]


def cache_targets(plan) -> list[Target]:
    return [_target(e) for e in inventory(plan) if purgeable(e)]


def _target(entry, reason: str | None = None) -> Target:
    return Target("program", str(entry.path), reason or f"{entry.state}: {entry.reason}".rstrip(": "),
                  entry.size_bytes, entry.program, entry.fingerprint)


def sidecar_targets(plan) -> list[Target]:
    from store import sidecar

    s = plan.sidecar
    if s is None or s.verdict != REPACK or s.reason not in SIDECAR_PURGE_REASONS:
        return []
    path = Path(s.path)
    try:
        st = os.lstat(path)
    except OSError:
        return []
    if not stat.S_ISREG(st.st_mode) or sidecar.ranks_of(path) is None:
        return []  # not a regular file of our own naming: never ours to delete
    return [Target("sidecar", str(path), f"{s.reason}: {s.detail}", st.st_size)]


def targets(plan, scope: str = PLAN) -> list[Target]:
    if scope == CACHE:
        return cache_targets(plan)
    return program_targets(plan) + sidecar_targets(plan)


def purge(plan, chosen: list[Target], scope: str = PLAN) -> list[Target]:
    """Delete `chosen` (a subset of `targets(plan, scope)`); returns what was deleted."""
    allowed = {(t.kind, t.path) for t in targets(plan, scope)}
    stray = [t for t in chosen if (t.kind, t.path) not in allowed]
    if stray:
        rule = "the plan no longer calls it stale or corrupt" if scope == PLAN else \
            "the kernel cache no longer calls it unusable"
        raise UserError(f"{stray[0].line()}: {rule}; nothing deleted")
    done = []
    programs = [t for t in chosen if t.kind == "program"]
    if programs:
        wanted = {t.path for t in programs}
        entries = [e for e in inventory(plan) if str(e.path) in wanted]
        removed = {str(e.path) for e in inv.remove(cache_of(plan).layout, entries)}
        done += [t for t in programs if t.path in removed]
    for t in chosen:
        if t.kind == "sidecar":
            try:
                os.unlink(t.path)
            except FileNotFoundError:
                continue
            done.append(t)
    return done
