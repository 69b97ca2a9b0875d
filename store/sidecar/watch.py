"""Knowing when a mapped sidecar changes under us (issue 11 item 3).

A MAP_SHARED mapping serves whatever the file holds *now*: a `truncate` makes the next page
fault a SIGBUS (the process dies with no word), and a same-size `cp` over it silently swaps
the weights. Two mechanisms, strongest first:

- a read lease (`fcntl F_SETLEASE F_RDLCK`) on the fd the sidecar was validated through: any
  open of the file for writing or truncation first *breaks the lease*. A non-blocking opener
  (GNU truncate) fails with EAGAIN; a blocking one (cp) waits until we release the lease or
  `/proc/sys/fs/lease-break-time` (45 s by default) passes. The kernel signals the holder
  (SIGIO, recorded by a handler installed here) and F_GETLEASE reports the pending break,
  so the service learns of the writer *before* a byte changes, stops using the mapping, and
  only then `release()`s.
- fd identity: size and mtime of the validated inode (fstat of the fd we keep), checked on
  every `changed()` call: what a lease cannot cover (no lease on this filesystem, or SIGIO
  left at its default, which would kill the process, and we are not on the main thread to
  install a handler) is seen after the fact, before the next request.

A path replaced by rename (what `dsv4 prepack --force` does) does not touch the mapped
inode: the service keeps serving the bytes it validated, which is correct.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("store.sidecar")

_broken: set[int] = set()  # fds whose lease break the SIGIO handler saw (set by the handler)
_live: set[Watch] = set()
_handler_lock = threading.Lock()
_previous: object = None


def _on_sigio(signum: int, frame: object) -> None:
    # Which lease broke is not in the signal; mark every watched fd whose lease is now pending.
    for w in list(_live):
        if w.lease and w._lease_pending():
            _broken.add(w.fd)
    if callable(_previous):
        _previous(signum, frame)


def install_sigio_handler() -> bool:
    """Install the lease-break handler; True when SIGIO is handled (or ignored) from now on.

    A lease needs it (SIGIO's default action kills the process) and Python installs signal
    handlers only from the main thread: a service that maps its sidecar in a worker thread
    calls this from the main thread first, else it gets the fstat watch only."""
    global _previous
    with _handler_lock:
        current = signal.getsignal(signal.SIGIO)
        if current is _on_sigio:
            return True
        if threading.current_thread() is not threading.main_thread():
            return current not in (signal.SIG_DFL, None)  # someone else handles or ignores it
        _previous = current
        signal.signal(signal.SIGIO, _on_sigio)
        return True


class Watch:
    """Whether the file behind `fd` (the fd a sidecar was validated and mapped through) changed."""

    def __init__(self, fd: int, path: Path, *, lease: bool = True) -> None:
        self.fd, self.path = fd, path
        st = os.fstat(fd)
        self.identity = (st.st_size, st.st_mtime_ns)
        self.lease = False
        self.mechanism = "fstat"
        self.reason = ""  # set once a change is seen; never cleared
        if lease and install_sigio_handler():
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
                self.lease, self.mechanism = True, "lease"
            except OSError as e:  # EACCES (not ours), EAGAIN (open for writing), EINVAL (fs)
                log.info("sidecar %s: no read lease (%s); watching size and mtime", path, e.strerror)
        _live.add(self)

    def _lease_pending(self) -> bool:
        try:
            return fcntl.fcntl(self.fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK
        except OSError:
            return True

    def changed(self) -> str | None:
        """Why the mapped bytes can no longer be trusted, or None. Cheap: two syscalls."""
        if self.reason:
            return self.reason
        if self.lease and (self.fd in _broken or self._lease_pending()):
            self.reason = "a process opened the sidecar for writing (read lease broken)"
        else:
            try:
                st = os.fstat(self.fd)
            except OSError as e:
                self.reason = f"cannot fstat the mapped sidecar ({e.strerror})"
            else:
                if (st.st_size, st.st_mtime_ns) != self.identity:
                    self.reason = (f"the mapped sidecar changed: size {self.identity[0]} → {st.st_size}, "
                                   f"mtime {self.identity[1]} → {st.st_mtime_ns}")
        if self.reason:
            log.error("sidecar %s: %s", self.path, self.reason)
        return self.reason or None

    def wait_changed(self, timeout: float, interval: float = 0.05) -> str | None:
        """Poll `changed()` until it says something or `timeout` seconds pass."""
        deadline = time.monotonic() + timeout
        while (reason := self.changed()) is None and time.monotonic() < deadline:
            time.sleep(interval)
        return reason

    def release(self) -> None:
        """Give the lease up (a waiting writer proceeds): only once nothing reads the mapping."""
        if self.lease:
            with contextlib.suppress(OSError):
                fcntl.fcntl(self.fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            self.lease = False
        _broken.discard(self.fd)
        _live.discard(self)


def poll_in_background(changed: Callable[[], str | None], on_change: Callable[[str], None],
                       interval: float = 0.5) -> Callable[[], None]:
    """Call `on_change(reason)` once, from a daemon thread, when `changed()` first says something
    (checked every `interval` s, so an idle service learns too). Returns a function that stops it."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval):
            reason = changed()
            if reason:
                on_change(reason)
                return

    threading.Thread(target=run, name="sidecar-watch", daemon=True).start()
    return stop.set
