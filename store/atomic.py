"""Crash-safe publication: stage beside the target, fsync, set the mode, rename.

A reader that trusts a final path must never see a partial file there, whatever moment a
process dies at. Staging names start with `.tmp-` so every reader can ignore them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

STAGING_PREFIX = ".tmp-"


def current_umask() -> int:
    # os.umask can only be read by setting it; restore immediately. Not thread-safe against
    # another thread creating files in the same instant, which we accept (CLI/worker processes).
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def shared_mode(base: int = 0o644) -> int:
    """The mode a published file gets: `base & ~umask` (never mkstemp's 0600)."""
    return base & ~current_umask()


def staging_name(final: Path) -> Path:
    """A per-writer staging path in the same directory (same filesystem: rename is atomic)."""
    return final.with_name(f"{STAGING_PREFIX}{final.name}.{socket.gethostname()}.{os.getpid()}.{os.urandom(4).hex()}")


def is_staging(name: str) -> bool:
    return name.startswith(STAGING_PREFIX)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (EPERM: it exists, not ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_STAGING = re.compile(r"\.tmp-(?P<stem>.+?)\.(?P<host>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}")


def staging_writer(name: str) -> tuple[str, int] | None:
    """(host, pid) of the writer of a staging name `.tmp-<stem>.<host>.<pid>.<rand8>`, or None.

    Stems and host names may both hold dots, so the split is ambiguous; this host's name is
    tried first, which is all liveness needs (a writer elsewhere cannot be checked anyway).
    For dot-free stems (the kernel cache's) the host is always exact.
    """
    m = _STAGING.fullmatch(name)
    if m is None:
        return None
    local = socket.gethostname()
    if name.endswith(f".{local}.{m.group('pid')}.{name[-8:]}"):
        return local, int(m.group("pid"))
    return m.group("host"), int(m.group("pid"))


def staging_writer_pid(name: str) -> int | None:
    """The writer's pid if `name` is a staging name made on this host."""
    writer = staging_writer(name)
    return writer[1] if writer is not None and writer[0] == socket.gethostname() else None


def publish(tmp: Path, final: Path, *, replace: bool = True) -> None:
    """Rename `tmp` to `final`; with replace=False fail (FileExistsError) if `final` exists.

    The no-replace form links then unlinks, so the existence check and the publication are one
    atomic step (a crash in between leaves the complete file at `final` and a staging leftover).
    """
    if not replace:
        try:
            os.link(tmp, final)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            # No hard links on this filesystem: check, then rename (a narrow race we accept).
            if os.path.lexists(final):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(final)) from e
        else:
            os.unlink(tmp)
            return
    os.replace(tmp, final)


@contextlib.contextmanager
def staged_file(
    final: Path, mode: int | None = None, *, replace: bool = True
) -> Iterator[tuple[Path, object]]:
    """Yield (temp path, binary file) in final's dir; on clean exit fsync, chmod and rename.

    On any exception the temp file is removed and nothing appears at `final`. With
    replace=False an existing `final` is never overwritten (FileExistsError).
    """
    final = Path(final)
    tmp = staging_name(final)
    f = open(tmp, "xb")  # noqa: SIM115 - closed below on every path
    try:
        yield tmp, f
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.chmod(tmp, shared_mode() if mode is None else mode)
        publish(tmp, final, replace=replace)
        fsync_dir(final.parent)
    except BaseException:
        f.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_bytes_atomic(final: Path, data: bytes, mode: int | None = None) -> None:
    with staged_file(final, mode) as (_, f):
        f.write(data)
