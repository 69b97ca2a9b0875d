"""`dsv4 sidecar warm|verify|evict`: reading a sidecar through the page cache.

`warm` reads it sequentially so the next launch finds it hot, checking every data chunk's
checksum as it goes (store.sidecar.checksum); `verify` only checks; `evict` drops its pages.
The target is resolved by console.cli.sidecar; these functions get the path.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from store import pagecache, safeio, sidecar
from store.errors import UserError
from store.sidecar import checksum
from store.units import format_size


def percent(fraction: float | None, method: str | None) -> str:
    return "-" if fraction is None else f"{fraction:.1%} ({method})"


class _Progress:
    """A single self-rewriting stderr line, at most a few times a second, only on a terminal."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, done: int, total: int, bytes_per_s: float) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.25 and done < total):
            return
        self.last = now
        pct = done / total if total else 1.0
        sys.stderr.write(
            f"\r{self.label}: {format_size(done)} / {format_size(total)} ({pct:.0%}) "
            f"at {format_size(bytes_per_s)}/s   "
        )
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def warm(args: argparse.Namespace, path: Path) -> int:
    bar = _Progress(f"warming {path.name}")
    progress = bar
    if args.events:
        from runtime.events import Event, open_sink

        sink = open_sink(args.events)
        last = [0.0]

        def progress(done: int, total: int, bytes_per_s: float) -> None:
            bar(done, total, bytes_per_s)
            if time.monotonic() - last[0] < 0.1 and done < total:
                return  # a few events a second is plenty for a progress bar
            last[0] = time.monotonic()
            sink(Event("warm", "progress", done=done, total=total, unit="bytes",
                       detail={"file": path.name, "bytes_per_s": round(bytes_per_s)}))

    try:
        check = None if args.no_verify else _verifier(path)
        verify_sink = check.feed if check is not None and not check.problem else None
        result = pagecache.warm(path, progress, willneed=not args.no_willneed, sink=verify_sink,
                                chunk=checksum.READ_BYTES)
    except OSError as e:
        raise UserError(
            f"{path}: cannot read ({e.strerror}); check the file and its permissions"
        ) from None
    recorded = result.cold_bytes_per_s
    verified = None if check is None else check.result()
    if args.events:  # the console shows "verified" and when from this event
        sink(Event("warm", "end", seconds=result.seconds, done=result.bytes_read, unit="bytes",
                   message=None if verified is None else verified.detail,
                   detail={"file": path.name, "verified": None if verified is None else verified.ok,
                           "verified_at": None if verified is None else time.time()}))  # fmt: skip
    if args.json:
        from console.cli.output import print_json

        extra = {} if verified is None else {"verify": verified.to_json()}
        print_json({**result.to_json(), "recorded_bytes_per_s": recorded, **extra})
        return 0 if verified is None or verified.ok else 1
    print(
        f"warmed {path}: {format_size(result.bytes_read)} in {result.seconds:.1f} s "
        f"({format_size(result.bytes_per_s)}/s); resident "
        f"{percent(result.after.fraction, result.after.method)}"
    )
    if recorded is not None:
        print(f"recorded this host's read throughput: {format_size(recorded)}/s")
    else:
        print(
            f"read throughput not recorded: only {format_size(result.cold_bytes)} were cold "
            f"(a measurement needs ≥ {format_size(pagecache.MIN_MEASURED_BYTES)} cold)"
        )
    if verified is not None:
        print(("verified: " if verified.ok else "NOT verified: ") + verified.detail)
    return 0 if verified is None or verified.ok else 1


def _verifier(path: Path) -> checksum.Verifier:
    """The chunk checker of a sidecar; one line (UserError) when its header is not sound."""
    fd = safeio.open_regular(path)
    try:
        return checksum.verifier(fd)
    except sidecar.CorruptSidecar as e:
        raise UserError(f"{path}: corrupt ({e}); repack it with `dsv4 prepack --force`") from None
    finally:
        os.close(fd)


def verify(args: argparse.Namespace, path: Path) -> int:
    bar = _Progress(f"verifying {path.name}")
    start = time.monotonic()
    try:
        result = checksum.verify_file(path, lambda done, total: bar(done, total, done / max(
            time.monotonic() - start, 1e-9)))
    except OSError as e:
        raise UserError(f"{path}: cannot read ({e.strerror}); check the file") from None
    except sidecar.CorruptSidecar as e:
        raise UserError(f"{path}: corrupt ({e}); repack it with `dsv4 prepack --force`") from None
    seconds = time.monotonic() - start
    if args.json:
        from console.cli.output import print_json

        print_json({"path": str(path), "seconds": seconds, **result.to_json()})
    elif result.ok:
        print(f"verified {path}: {result.detail} in {seconds:.2f} s")
    else:
        print(f"{path}: NOT verified: {result.detail}")
        for i, tensors in result.bad[:20]:
            print(f"  chunk {i} (bytes {i * result.chunk_bytes}…): {', '.join(tensors) or '-'}")
    return 0 if result.ok else 1


def evict(args: argparse.Namespace, path: Path) -> int:
    try:
        after = pagecache.evict(path)
    except OSError as e:
        raise UserError(f"{path}: cannot evict ({e.strerror}); check the file") from None
    if args.json:
        from console.cli.output import print_json

        print_json({"path": str(path), "residency": after.fraction, **after.to_json()})
        return 0
    print(f"evicted {path}: resident {percent(after.fraction, after.method)}")
    return 0
