"""What a purge may delete: exactly what the plan of *this* checkpoint calls stale or corrupt.

Program entries: those of this model's programs that its live keys judge stale (built by another
toolchain or from other source) or corrupt; entries of other programs, other configurations
(`other-layout`) and current ones are never touched. The sidecar: only when its verdict against
the live source key is REPACK because it is stale, corrupt or holds other tensors — never when it
would MAP, is merely cold, or its checkpoint cannot be read (that says nothing about the file).
"""

from __future__ import annotations

import os
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from store.errors import UserError

SIDECAR_PURGE_REASONS = ("stale", "corrupt", "names")


@dataclass(frozen=True)
class Target:
    kind: str  # program | sidecar
    path: str
    reason: str  # why the plan calls it stale or corrupt
    size_bytes: int
    program: str = ""
    fingerprint: str = ""

    def line(self) -> str:
        what = f"{self.program}/{self.fingerprint[:12]}" if self.kind == "program" else self.path
        return f"{self.kind} {what}: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def program_targets(plan, cache_dir: Path | None = None) -> list[Target]:
    from runtime.programs import reference
    from store.kernel_cache import CORRUPT, STALE, KernelCache
    from store.paths import kernel_cache_dir

    if not plan.keys:
        return []
    cache = KernelCache(kernel_cache_dir(cache_dir or plan.settings.kernel_cache_dir))
    if not cache.root.is_dir():
        return []
    entries = cache.inventory(reference(plan.device, plan.keys))
    # the inventory hashes nothing; the plan verified each entry it would load: an artifact whose
    # sha256 differs is CORRUPT there, and purgeable, even though its listing looks current
    corrupt = {p.entry: p.reason for p in plan.programs if p.state == "CORRUPT" and p.entry}
    return [Target("program", str(e.path), corrupt.get(str(e.path)) or e.reason or e.state, e.size_bytes,
                   e.program, e.fingerprint)
            for e in entries if e.program in plan.keys and not e.busy
            and (e.state in (STALE, CORRUPT) or str(e.path) in corrupt)]


def sidecar_targets(plan) -> list[Target]:
    from store import sidecar

    s = plan.sidecar
    if s.get("verdict") != "REPACK" or s.get("reason") not in SIDECAR_PURGE_REASONS:
        return []
    path = Path(s["path"])
    try:
        st = os.lstat(path)
    except OSError:
        return []
    if not stat.S_ISREG(st.st_mode) or sidecar.ranks_of(path) is None:
        return []  # not a regular file of our own naming: never ours to delete
    return [Target("sidecar", str(path), f"{s['reason']}: {s.get('detail', '')}", st.st_size)]


def targets(plan) -> list[Target]:
    return program_targets(plan) + sidecar_targets(plan)


def purge(plan, chosen: list[Target]) -> list[Target]:
    """Delete `chosen` (a subset of `targets(plan)`); returns what was deleted."""
    from store.kernel_cache import KernelCache
    from store.paths import kernel_cache_dir

    allowed = {(t.kind, t.path) for t in targets(plan)}
    stray = [t for t in chosen if (t.kind, t.path) not in allowed]
    if stray:
        raise UserError(f"{stray[0].line()}: the plan no longer calls it stale or corrupt; nothing deleted")
    done = []
    programs = [t for t in chosen if t.kind == "program"]
    if programs:
        cache = KernelCache(kernel_cache_dir(plan.settings.kernel_cache_dir))
        wanted = {t.path for t in programs}
        from runtime.programs import reference

        entries = [e for e in cache.inventory(reference(plan.device, plan.keys)) if str(e.path) in wanted]
        removed = {str(e.path) for e in cache.remove(entries)}
        done += [t for t in programs if t.path in removed]
    for t in chosen:
        if t.kind == "sidecar":
            try:
                os.unlink(t.path)
            except FileNotFoundError:
                continue
            done.append(t)
    return done
