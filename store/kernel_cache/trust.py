"""Whose cache is this: the ownership marker, permissions, and staying inside the root.

A kernel cache root is ours when it carries the marker file the project writes when it creates
the root (`dsv4-kernel-cache.json`, format version inside). An unmarked directory that is not
empty is refused, for reading and writing alike: pointing `--kernel-cache-dir` at an ordinary
directory that happens to hold `quarantine/` or `.trash/` must never delete a byte of it.

A compiled program is executable code: a root, `v1` or program dir that is group/world-writable
or owned by another user is refused too (`UntrustedCacheError`, one line: why and how to fix).
Everything deleted or moved must sit in a real directory chain under the root (no symlinked
component) and carry a name the project's own naming produced (entry.ENTRY_NAME, …).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from store import safeio
from store.atomic import is_staging, shared_mode, staging_writer, write_bytes_atomic
from store.errors import UserError
from store.kernel_cache.entry import (
    ENTRY_NAME,
    FORMAT_VERSION,
    LOCKS,
    QUARANTINE,
    QUARANTINE_NAME,
    TRASH,
    VERSION_DIR,
    Untrusted,
    check_program_name,
)  # fmt: skip
from store.kernel_cache.layout import Layout

MARKER = "dsv4-kernel-cache.json"
MAX_MARKER_BYTES = 4096
_GROUP_OR_WORLD_WRITE = stat.S_IWGRP | stat.S_IWOTH
FLAG_HINT = "--kernel-cache-dir or DSV4_KERNEL_CACHE_DIR"


class UntrustedCacheError(UserError):
    """The cache root may contain code written by someone else, or is not a kernel cache."""


def ownership_problem(st: os.stat_result) -> str | None:
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    if st.st_mode & _GROUP_OR_WORLD_WRITE:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def dir_mode() -> int:
    # Never group/world-writable whatever the umask: our own trust check would refuse it.
    return shared_mode(0o755) & ~_GROUP_OR_WORLD_WRITE


def ensure_dir(path: Path) -> None:
    try:
        path.mkdir(mode=0o755)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise UntrustedCacheError(f"{path}: expected a directory of the kernel cache, found "
                                      f"{safeio.kind(os.lstat(path).st_mode)}") from None
        return
    os.chmod(path, dir_mode())


def marker_problem(root: Path) -> str | None:
    """Why `root` is not a kernel cache we may act in, or None (marked, empty or absent)."""
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{root}: cannot read ({e.strerror}); use a kernel cache dir of your own ({FLAG_HINT})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{root}: is {safeio.kind(st.st_mode)}, not a directory; point {FLAG_HINT} at a directory"
    raw = None
    for _ in range(2):  # a concurrent creator may publish the marker between our two looks
        try:
            raw = safeio.read_regular(root / MARKER, MAX_MARKER_BYTES)
            break
        except FileNotFoundError:
            try:
                # A writer's staging file of the marker itself does not count.
                with os.scandir(root) as it:
                    names = [d.name for d in it if not is_staging(d.name)]
            except OSError as e:
                return f"{root}: cannot list ({e.strerror}); check its permissions"
            if not names:
                return None
            if MARKER not in names:
                return (f"{root}: not a kernel cache (no {MARKER}) and not empty; refusing to use "
                        f"it. Point {FLAG_HINT} at an empty or new directory (a cache made by an "
                        f"older dsv4: `dsv4 cache adopt --kernel-cache-dir {root}`)")
        except OSError as e:
            return f"{root / MARKER}: unreadable marker ({e.strerror}); remove the directory or use another"
    if raw is None:
        return f"{root / MARKER}: marker vanished while reading it; try again"
    try:
        data = json.loads(raw)
        version = int(data["format"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return f"{root / MARKER}: malformed marker; remove the directory or use another"
    if version != FORMAT_VERSION:
        return (f"{root}: kernel cache format {version}, this dsv4 reads {FORMAT_VERSION}; "
                f"use another directory ({FLAG_HINT})")
    return None


def write_marker(root: Path) -> None:
    """Mark a root the project has just created (or found empty) as a kernel cache."""
    if (root / MARKER).exists():
        return
    body = {"format": FORMAT_VERSION, "what": "dsv4 kernel cache (compiled programs)",
            "created": time.time()}
    write_bytes_atomic(root / MARKER, json.dumps(body, indent=1).encode())


def trust_problem(layout: Layout, program: str | None = None) -> str | None:
    """Why acting in this root (and program dir) is refused, or None. Ownership first: a root
    of another user is refused as such even when we cannot read its marker."""
    for d in layout.trusted_dirs(program):
        try:
            st = os.stat(d)
        except (FileNotFoundError, NotADirectoryError):  # the marker check says what is wrong
            break
        except OSError as e:
            return f"{d}: cannot read ({e.strerror}); check its permissions"
        problem = ownership_problem(st)
        if problem:
            fix = f"run `chmod go-w {d}` or use" if "writable" in problem else "use"
            return (
                f"refusing to load programs from {d}: it is {problem} and a compiled program "
                f"is executable code; {fix} a kernel cache dir of your own ({FLAG_HINT})"
            )
    return marker_problem(layout.root)


def check_trust(layout: Layout, program: str | None = None) -> None:
    """Raise UntrustedCacheError (one line: why and how to fix) when `trust_problem` says so."""
    problem = trust_problem(layout, program)
    if problem:
        raise UntrustedCacheError(problem)


def inside(root: Path, path: Path) -> bool:
    """Whether `path`'s parent dirs up to `root` are real directories (no symlink leads out)."""
    try:
        rel = path.parent.relative_to(root)
    except ValueError:
        return False
    here = root
    for part in rel.parts:
        here = here / part
        try:
            if not stat.S_ISDIR(os.lstat(here).st_mode):
                return False
        except OSError:
            return False
    return True


def check_entry_path(root: Path, path: Path) -> os.stat_result:
    if path.is_symlink():
        target = path.resolve()
        if not target.is_relative_to(root.resolve()):
            raise Untrusted(f"{path.name} is a symlink leading outside the cache root ({target})")
    st = os.stat(path)
    problem = ownership_problem(st)
    if problem:
        raise Untrusted(f"{path.name} is {problem}")
    return st


def open_trusted(root: Path, entry: Path, dfd: int, name: str) -> int:
    """An fd on the regular file `name` in the entry dir `dfd`, owned by us and inside root."""
    if stat.S_ISLNK(os.lstat(name, dir_fd=dfd).st_mode):
        target = (entry / os.readlink(name, dir_fd=dfd)).resolve()
        if not target.is_relative_to(root.resolve()):
            raise Untrusted(f"{name} is a symlink leading outside the cache root ({target})")
    fd = safeio.open_regular(name, dir_fd=dfd)
    problem = ownership_problem(os.fstat(fd))
    if problem:
        os.close(fd)
        raise Untrusted(f"{name} is {problem}")
    return fd


def scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def real_dirs(path: Path) -> Iterator[os.DirEntry[str]]:
    """Sub-directories of `path` that are directories themselves, never symlinks to one."""
    for d in scandir(path):
        if not d.name.startswith(".") and d.is_dir(follow_symlinks=False):
            yield d


def tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_size
    return total


def ours(layout: Layout, path: Path) -> bool:
    """Whether `path` is something this project named, in a real directory under the root."""
    name = path.name
    if path.parent == layout.quarantine:
        named = QUARANTINE_NAME.fullmatch(name) is not None
    elif path.parent.parent == layout.base:
        named = ENTRY_NAME.fullmatch(name) is not None or staging_writer(name) is not None
    else:
        named = False
    return named and inside(layout.root, path)


def require_marked(layout: Layout) -> None:
    problem = marker_problem(layout.root)
    if problem:
        raise UntrustedCacheError(problem)


def adopt(root: Path) -> None:
    """Mark a root made by an older dsv4 (before the marker existed) as ours, only if it and
    everything in it is owned by us and named as dsv4 names things; UntrustedCacheError if not."""

    def refuse(why: str) -> None:
        raise UntrustedCacheError(f"{root}: not adopted: {why}")

    try:
        st = os.stat(root)
    except OSError as e:
        raise UntrustedCacheError(f"{root}: cannot read ({e.strerror})") from None
    if not stat.S_ISDIR(st.st_mode):
        refuse(f"it is {safeio.kind(st.st_mode)}")
    if (root / MARKER).exists():
        return
    if problem := ownership_problem(st):
        refuse(f"it is {problem}")
    allowed = {VERSION_DIR: None, QUARANTINE: QUARANTINE_NAME, TRASH: None}
    for d in scandir(root):
        if is_staging(d.name):
            continue
        if d.name not in allowed or not d.is_dir(follow_symlinks=False):
            refuse(f"{d.name!r} is not something dsv4 puts in a kernel cache")
        if problem := ownership_problem(d.stat(follow_symlinks=False)):
            refuse(f"{d.name} is {problem}")
    for q in scandir(root / QUARANTINE):
        if QUARANTINE_NAME.fullmatch(q.name) is None:
            refuse(f"{QUARANTINE}/{q.name} is not a quarantined entry")
    for d in scandir(root / VERSION_DIR):
        if d.name == LOCKS:
            continue
        try:
            check_program_name(d.name)
        except ValueError:
            refuse(f"{VERSION_DIR}/{d.name} is not a program dir")
        if not d.is_dir(follow_symlinks=False):
            refuse(f"{VERSION_DIR}/{d.name} is not a directory")
        for child in scandir(Path(d.path)):
            if ENTRY_NAME.fullmatch(child.name) is None and not is_staging(child.name):
                refuse(f"{VERSION_DIR}/{d.name}/{child.name} is not an entry")
    write_marker(root)
