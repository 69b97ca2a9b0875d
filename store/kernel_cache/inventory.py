"""The cache as an operator sees it: ls (inventory), verify, gc, purge, quarantine, trash.

Every deletion renames into `<root>/.trash` first and deletes after, so readers never see a
half-deleted entry. Only inside a marked root (trust.marker_problem), only paths whose parent
chain is real directories under the root, and only names the project's own naming produced:
nothing else is ever moved or deleted. Reads are capped (manifests, quarantine records) and
never block on a special file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from store import safeio
from store.atomic import is_staging, pid_alive, staging_writer
from store.kernel_cache.entry import (
    CORRUPT,
    HITS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    PARTIAL,
    QUARANTINED,
    TRASH_NAME,
    Corrupt,
    Entry,
    Manifest,
    Reference,
    Verification,
    judge,
)  # fmt: skip
from store.kernel_cache.layout import Layout, rand
from store.kernel_cache.quarantine import quarantine, quarantined
from store.kernel_cache.read import artifact_sizes, entry_dirs
from store.kernel_cache.trust import (
    ensure_dir,
    marker_problem,
    ours,
    real_dirs,
    require_marked,
    scandir,
    tree_size,
)  # fmt: skip
from store.units import format_age

# A staging dir older than this is abandoned (sooner if its writer on this host is gone).
STAGING_MAX_AGE = 3600.0
# What gc removes before evicting anything: entries that can never be used.
GARBAGE = (PARTIAL, CORRUPT, QUARANTINED)


def remove(layout: Layout, entries: Iterable[Entry]) -> list[Entry]:
    """Delete entries safely while others read: rename each into the trash, then delete.
    Busy partial entries (their writer may still be running) and paths not ours are skipped."""
    require_marked(layout)
    trash = layout.trash
    removed = []
    for e in entries:
        if e.busy or not ours(layout, e.path):
            continue
        ensure_dir(trash)
        try:
            os.rename(e.path, trash / f"{e.path.name}.{rand()}")
        except FileNotFoundError:
            continue
        removed.append(e)
    empty_trash(layout)
    return removed


def empty_trash(layout: Layout) -> None:
    """Delete what our own removals put in the trash; a symlink is unlinked, never followed."""
    trash = layout.trash
    try:
        if marker_problem(layout.root) or not stat.S_ISDIR(os.lstat(trash).st_mode):
            return
    except OSError:
        return
    for d in scandir(trash):
        if TRASH_NAME.fullmatch(d.name) is None:
            continue
        if d.is_dir(follow_symlinks=False):
            shutil.rmtree(d.path, ignore_errors=True)  # rmtree never follows inner symlinks
        else:
            with contextlib.suppress(OSError):
                os.unlink(d.path)


def sweep_staging(layout: Layout, program: str) -> list[Entry]:
    """Remove the abandoned staging dirs of one program (crashed or long-dead writers)."""
    stale = []
    for d in scandir(layout.base / program):
        if is_staging(d.name):
            entry = partial_entry(program, Path(d.path))
            if not entry.busy:
                stale.append(entry)
    return remove(layout, stale)


def gc(layout: Layout, max_size: int, reference: Reference | None = None) -> list[Entry]:
    """Remove abandoned staging dirs, corrupt and quarantined entries, then least recently used
    entries until the cache holds at most `max_size` bytes."""
    entries = inventory(layout, reference)
    garbage = [e for e in entries if e.state in GARBAGE and not e.busy]
    removed = remove(layout, garbage)
    gone = {e.path for e in garbage}
    total = sum(e.size_bytes for e in entries if e.path not in gone)
    evict = []
    for e in sorted((e for e in entries if e.path not in gone), key=lambda e: e.last_used):
        if total <= max_size:
            break
        if e.busy:
            continue
        evict.append(e)
        total -= e.size_bytes
    return removed + remove(layout, evict)


def programs(layout: Layout) -> list[str]:
    return sorted(d.name for d in real_dirs(layout.base))


def inventory(layout: Layout, reference: Reference | None = None) -> list[Entry]:
    """Every entry, staging dir and quarantined entry, with its state against `reference`.

    Checks structure (manifest, file presence and sizes) but hashes nothing: `verify` does.
    """
    require_marked(layout)
    reference = reference or Reference()
    out: list[Entry] = []
    for program in programs(layout):
        for child in sorted(scandir(layout.base / program), key=lambda d: d.name):
            if is_staging(child.name):
                out.append(partial_entry(program, Path(child.path)))
            elif not child.name.startswith("."):
                out.append(_entry(program, child, reference))
    out.extend(quarantined(layout))
    return out


def verify(layout: Layout, read_verified: Callable[[Path, str, str], object]) -> Verification:
    """Hash every entry with `read_verified(entry, program, fp)` (the cache's, which counts
    what it hashes); quarantine those that fail. They are listed CORRUPT, with the reason
    they failed, at the place they were moved to."""
    require_marked(layout)
    checked, bad = 0, []
    for program in programs(layout):
        for fp, entry in entry_dirs(layout, program):
            checked += 1
            try:
                read_verified(entry, program, fp)
            except FileNotFoundError:
                continue
            except Corrupt as e:
                size = tree_size(entry)
                dest = quarantine(layout, entry, f"{e.kind}: {e}", expect=e.dir_id)
                if dest is not None:
                    bad.append(Entry(program, fp, CORRUPT, f"{e.kind}: {e}", size, 0.0, 0.0, 0, dest))
    return Verification(checked, tuple(bad))


def _entry(program: str, child: os.DirEntry[str], reference: Reference) -> Entry:
    # Plain strings and one read per manifest: `ls` over thousands of entries stays fast.
    path, fp = child.path, child.name
    hits, last_used = _hit_stats(path)
    try:
        if not child.is_dir(follow_symlinks=False):
            raise Corrupt(f"not a directory ({safeio.kind(child.stat(follow_symlinks=False).st_mode)})"
                          if not child.is_symlink() else "a symlink, not an entry directory")
        raw = safeio.read_regular(os.path.join(path, MANIFEST), MAX_MANIFEST_BYTES)
        manifest = Manifest.parse(raw, program, fp)
        size = len(raw) + artifact_sizes(path, manifest)
    except (OSError, Corrupt) as e:
        reason = str(e) if isinstance(e, Corrupt) else f"unreadable: {e.strerror or e}"
        size = tree_size(Path(path)) if child.is_dir(follow_symlinks=False) else 0
        return Entry(program, fp, CORRUPT, reason, size, 0.0, last_used, hits, Path(path))
    state, reason = judge(manifest, reference)
    return Entry(
        program, fp, state, reason, size, manifest.created, last_used or manifest.created, hits, Path(path),
        origin=manifest.origin,
    )


def _hit_stats(entry: str) -> tuple[int, float]:
    try:
        st = os.stat(os.path.join(entry, HITS))
    except OSError:
        return 0, 0.0
    return st.st_size, st.st_mtime


def partial_entry(program: str, path: Path) -> Entry:
    try:
        mtime = os.lstat(path).st_mtime
    except OSError:
        mtime = time.time()
    age = max(0.0, time.time() - mtime)
    writer = staging_writer(path.name)
    alive = pid_alive(writer[1]) if writer and writer[0] == socket.gethostname() else None
    # Young staging dirs may still be filling unless their writer is provably gone; old ones
    # are abandoned whatever the pid says (pids get reused).
    busy = age < STAGING_MAX_AGE and alive is not False
    who = f"pid {writer[1]} on {writer[0]}" if writer else "unknown writer"
    status = "writer running" if alive else "writer gone" if alive is False else "writer on another host"
    reason = f"staging dir of {who}, age {format_age(age)} ({status})"
    fp = path.name[len(".tmp-"):].split(".")[0]
    return Entry(program, fp, PARTIAL, reason, tree_size(path), mtime, mtime, 0, path, busy=busy)

