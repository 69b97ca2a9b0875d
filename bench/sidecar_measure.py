"""How `dsv4 bench sidecar` measures: best-of and median timing, touching every page of the
tensors, a child process's wall time and peak RSS, page-cache residency probes (cachestat,
mincore, util-linux `fincore`), `cat` from the page cache, and the rows they report as.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
RUNS = 5  # best-of runs for the quick rows


@dataclass
class Row:
    kind: str  # "measure" | "target" | "context"
    name: str
    seconds: float | None = None
    vs_packing: float | None = None  # packing seconds / these seconds (>1: faster)
    bytes: int | None = None
    note: str = ""
    measured: str = ""  # targets: the measured value, in words
    met: bool | None = None
    key: str = ""  # targets: the figure's stable name in --json (its value: `ratio`)
    ratio: float | None = None


def best(fn: Callable[[], Any], runs: int) -> tuple[float, Any]:
    fastest, out = math.inf, None
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        fastest = min(fastest, time.perf_counter() - t0)
    return fastest, out


def median(fn: Callable[[], Any], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def touch_pages(tensors: dict) -> int:
    """Sum one byte of every 4 KiB of every tensor (faults the mapping in, copies nothing)."""
    import torch

    total = 0
    for t in tensors.values():
        if t.numel():
            total += int(t.reshape(-1).view(torch.uint8)[::4096].sum())
    return total


def largest_layer_bytes(layout) -> tuple[str, int]:
    """The packing group (top, a layer, an MTP layer) whose packed slices are largest."""
    from store.sidecar import DTYPE_SIZES

    sizes = {}
    for group, params in layout.groups:
        n = 0
        for p in params:
            slot = layout.slots[p.name]
            for name in slot.names:
                t = layout.tensors[name]
                n += math.prod(t.shape[len(slot.index) :]) * DTYPE_SIZES[t.dtype]
        sizes[group] = n
    group = max(sizes, key=sizes.__getitem__)
    return group, sizes[group]


@dataclass(frozen=True)
class ChildUsage:
    seconds: float
    max_rss: int  # ru_maxrss: anonymous and file-backed pages together
    anon_peak: int  # sampled from /proc/PID/status every SAMPLE_S (may miss a short spike)
    file_peak: int  # mapped file pages (checkpoint shards read through mmap): page cache


SAMPLE_S = 0.02


def _status_kib(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return {
                k: int(v.split()[0])
                for k, _, v in (line.partition(":") for line in f)
                if k in ("RssAnon", "RssFile")
            }
    except (OSError, ValueError):
        return {}


def run_measured(argv: list[str]) -> ChildUsage:
    """Run a child to completion: wall time, ru_maxrss, and sampled anon/file RSS peaks."""
    import threading

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    peaks = {"RssAnon": 0, "RssFile": 0}
    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(SAMPLE_S):
                for k, v in _status_kib(proc.pid).items():
                    peaks[k] = max(peaks[k], v)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            tail = err.read().decode(errors="replace").strip()[-500:]
            raise RuntimeError(f"{' '.join(argv[-4:])} exited {proc.returncode}: {tail}")
    return ChildUsage(
        seconds, usage.ru_maxrss * 1024, peaks["RssAnon"] * 1024, peaks["RssFile"] * 1024
    )


def _fincore(path: Path) -> None:
    subprocess.run(
        ["fincore", "--bytes", "--noheadings", str(path)], check=True, stdout=subprocess.DEVNULL
    )


def cat(path: Path) -> None:
    with open(os.devnull, "wb") as null:
        subprocess.run(["cat", str(path)], check=True, stdout=null)


def probe_rows(label: str, path: Path, have_fincore: bool) -> tuple[list[Row], dict[str, float]]:
    from store import pagecache

    rows, times = [], {}
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        for method, runs in (("cachestat", 50), ("mincore", 10)):
            try:
                res = pagecache.residency(fd, method=method)
            except OSError as e:
                rows.append(Row("measure", f"probe {label}: {method}", note=f"unavailable ({e})"))
                continue
            s = median(lambda m=method: pagecache.residency(fd, method=m), runs)
            times[method] = s
            note = f"median of {runs}; {res.fraction:.1%} resident"
            rows.append(Row("measure", f"probe {label}: {method}", s, bytes=size, note=note))
    finally:
        os.close(fd)
    if have_fincore:
        s = median(lambda: _fincore(path), 5)
        times["fincore"] = s
        rows.append(
            Row(
                "measure",
                f"probe {label}: fincore",
                s,
                bytes=size,
                note="median of 5; util-linux subprocess",
            )
        )
    else:
        rows.append(
            Row("measure", f"probe {label}: fincore", note="skipped: fincore not installed")
        )
    return rows, times


def write_real_bytes(path: Path, size: int) -> None:
    """A file of real (non-sparse) bytes: sparse holes are never in the page cache."""
    chunk = os.urandom(16 << 20)
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
