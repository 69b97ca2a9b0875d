"""The loader: judge and map a sidecar through one file descriptor, as zero-copy torch views.

Everything goes through one fd (fstat, header, validation, residency, mmap), so a concurrent
`os.replace` of the path can never mix two files in one load. That fd stays open while mapped,
holding a read lease (store.sidecar.watch): `MappedSidecar.changed()` says when a writer
wants the file, before it changes a byte; the service stops, then `release()`s. The mapping is MAP_SHARED +
PROT_READ: page-cache pages are shared, never copied on write, and the views are truly
read-only — writing through one kills the process with SIGSEGV, so consumers copy
(`.clone()`, `.to(device)`) before any in-place op. Writers always publish by rename;
truncating a mapped sidecar in place would SIGBUS its readers, which is why nothing does.

The only module of the package that imports torch, and only inside functions.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from store.checkpoint import DTYPE_SIZES
from store.fingerprint import Key
from store.sidecar.format import Header, TensorShape
from store.sidecar.verdict import (
    DEFAULT_COLD_THRESHOLD,
    MAP,
    Reason,
    Verdict,
    check_args,
    judge,
    open_checked,
    repack,
)
from store.sidecar.watch import Watch, poll_in_background

if TYPE_CHECKING:
    import torch

log = logging.getLogger("store.sidecar")


def torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {
        "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8,
        "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
        "F8_E8M0": torch.float8_e8m0fnu,
        "I16": torch.int16, "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16,
        "I32": torch.int32, "U32": torch.uint32, "F32": torch.float32,
        "I64": torch.int64, "U64": torch.uint64, "F64": torch.float64, "C64": torch.complex64,
    }  # fmt: skip



class MappedSidecar:
    """Zero-copy, read-only tensor views over one MAP_SHARED/PROT_READ mapping of a sidecar."""

    def __init__(self, path: Path, verdict: Verdict, metadata: dict[str, str], mm: mmap.mmap,
                 tensors: dict[str, torch.Tensor], watch: Watch) -> None:  # fmt: skip
        self.path = path
        self.verdict = verdict
        self.metadata = metadata
        self.tensors = tensors
        self._mm: mmap.mmap | None = mm
        self._watch: Watch | None = watch
        # Collected without close(): still give the lease and the fd back (no stale lease
        # would stall a later writer of this file in this process for lease-break-time).
        self._finalizer = weakref.finalize(self, _let_go, watch)

    @property
    def watched_by(self) -> str:
        """How a change is noticed: "lease" (before it happens) or "fstat" (right after)."""
        return self._watch.mechanism if self._watch else "closed"

    def changed(self) -> str | None:
        """Why the mapped bytes are no longer the validated ones (or are about to stop being:
        a writer is waiting on our lease), or None. Poll it: per request and every ~0.5 s."""
        return self._watch.changed() if self._watch else None

    def notify(self, on_change: Callable[[str], None], interval: float = 0.5) -> Callable[[], None]:
        """Call `on_change(reason)` once from a background thread when `changed()` says
        something (the service: stop admitting, 503 with the reason, record it, release, exit).
        Returns a function that stops watching."""
        return poll_in_background(self.changed, on_change, interval)

    def release(self) -> None:
        """Let a writer waiting on our lease proceed. Call only once nothing reads the
        tensors any more (stop serving first): afterwards the mapping may SIGBUS."""
        if self._watch is not None:
            self._watch.release()

    def close(self) -> None:
        """Drop our views and unmap. Views the caller still holds keep the mapping alive
        until they are released (the pages stay valid; nothing dangles)."""
        self.tensors = {}
        mm, self._mm = self._mm, None
        if mm is not None:
            # Views still held elsewhere keep the mapping; it goes when the last one does.
            with contextlib.suppress(BufferError):
                mm.close()
        self._watch = None
        self._finalizer()

    def __enter__(self) -> MappedSidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _let_go(watch: Watch) -> None:
    watch.release()
    with contextlib.suppress(OSError):
        os.close(watch.fd)


def open_sidecar(
    path: Path | str,
    *,
    expected_key: Key | None = None,
    expected_names: Collection[str] | None = None,
    expected_tensors: Iterable[TensorShape] | None = None,
    cold_threshold: float = DEFAULT_COLD_THRESHOLD,
    cold_policy: str = "auto",
    residency_method: str | None = None,
) -> tuple[Verdict, MappedSidecar | None]:
    """Judge and, on MAP, map a sidecar — all through one file descriptor.

    Logs one line for every verdict (REPACK at warning level) and never raises for anything
    wrong with the file: every such case is a REPACK with a reason.
    """
    check_args(cold_threshold, cold_policy)
    path = Path(path)
    opened = open_checked(path)
    if isinstance(opened, Verdict):
        log.warning("%s", opened.line())
        return opened, None
    fd = opened
    # The lease is taken before the first byte is judged: a writer from here on is noticed.
    watch = Watch(fd, path)
    keep = False
    try:
        verdict, header = judge(
            fd, path, expected_key=expected_key, expected_names=expected_names,
            expected_tensors=expected_tensors,
            cold_threshold=cold_threshold, cold_policy=cold_policy,
            residency_method=residency_method,
        )  # fmt: skip
        if verdict.action != MAP or header is None:
            log.warning("%s", verdict.line())
            return verdict, None
        try:
            mm = mmap.mmap(fd, verdict.size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            verdict = repack(path, Reason.CORRUPT, f"cannot map ({e})", size_bytes=verdict.size_bytes)
            log.warning("%s", verdict.line())
            return verdict, None
        reason = watch.changed()
        if reason:  # changed between the open and the map: what we judged is not what is there
            mm.close()
            verdict = repack(path, Reason.CORRUPT, f"changed while loading: {reason}",
                             size_bytes=verdict.size_bytes)  # fmt: skip
            log.warning("%s", verdict.line())
            return verdict, None
        keep = True
    finally:
        if not keep:  # the fd stays open with a mapping: it holds the lease and the identity
            watch.release()
            os.close(fd)
    if verdict.cold_read and hasattr(mmap, "MADV_WILLNEED"):
        mm.madvise(mmap.MADV_WILLNEED)  # start the read now rather than fault by fault
    tensors = _views(mm, header)
    log.info("%s", verdict.line())
    return verdict, MappedSidecar(path, verdict, dict(header.metadata), mm, tensors, watch)


def _views(mm: mmap.mmap, header: Header) -> dict[str, torch.Tensor]:
    import torch

    dtypes = torch_dtypes()
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # PROT_READ buffers are not writable; torch warns once. Read-only is the point.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for e in header.entries:
            dtype = dtypes[e.dtype]
            count = (e.end - e.begin) // DTYPE_SIZES[e.dtype]
            if count == 0:
                out[e.name] = torch.empty(e.shape, dtype=dtype)
                continue
            flat = torch.frombuffer(mm, dtype=dtype, count=count, offset=e.begin)
            out[e.name] = flat.view(e.shape)
    return out
