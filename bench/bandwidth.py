"""This host's memory bandwidth on the cores the service uses: a STREAM-style triad (a = b + s·c)
and a read-only pass (a sum), from a small C kernel built with the project's own compiler and
flags (`runtime.model.native`) plus `-march=native` (it runs where it is built, and is never
cached), on torch's OpenMP runtime and torch's thread count (what one rank of `dsv4 serve` uses).

Arrays of ARRAY_BYTES each, far past any last-level cache (32 MiB on the hosts measured), touched
once before the clock starts (page faults are not bandwidth). Each figure is the best of `runs`
passes (STREAM's convention): bandwidth is a ceiling, and a slow pass on a shared host is another
process's time, not the memory's. Bytes counted as STREAM counts them: the triad reads two arrays
and writes one (3 × the array; the write-allocate read a cache makes is not counted), the sum reads one.
"""

from __future__ import annotations

import ctypes
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ARRAY_BYTES = 256 << 20

SOURCE = r"""
#include <stdint.h>
/* the sum of a[0..n): 16 independent sums a thread, so the adds never wait on each other and the
   loop vectorises without reassociating one sum (no -ffast-math) */
extern "C" double bw_read(const float *a, int64_t n, int threads) {
    double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        float s[16] = {0};
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n - 15; i += 16)
            for (int k = 0; k < 16; k++) s[k] += a[i + k];
        for (int k = 0; k < 16; k++) total += s[k];
    }
    return total;
}

extern "C" void bw_triad(float *a, const float *b, const float *c, float s, int64_t n, int threads) {
#pragma omp parallel for simd num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) a[i] = b[i] + s * c[i];
}
"""


@dataclass(frozen=True)
class Bandwidth:
    read_gbs: float  # the read-only pass: a decode step's bound (it reads weights, writes little)
    triad_gbs: float
    threads: int

    def to_json(self) -> dict:
        return {"read_gbs": round(self.read_gbs, 2), "triad_gbs": round(self.triad_gbs, 2), "threads": self.threads}


class Meter:
    """The kernel built and its arrays allocated once; `measure` as often as the turns need."""

    def __init__(self, array_bytes: int = ARRAY_BYTES):
        import torch

        from runtime.model.native import FLAGS, compiler

        self._tmp = tempfile.TemporaryDirectory(prefix="dsv4-bandwidth-")
        src, lib = Path(self._tmp.name) / "bw.cpp", Path(self._tmp.name) / "bw.so"
        src.write_text(SOURCE)
        done = subprocess.run([compiler(), *FLAGS, "-march=native", str(src), "-o", str(lib)], capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"the bandwidth kernel did not compile: {done.stderr.strip()[-1000:]}")
        self._lib = ctypes.CDLL(str(lib))
        self._lib.bw_read.restype = ctypes.c_double
        self._lib.bw_read.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
        self._lib.bw_triad.restype = None
        self._lib.bw_triad.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                                       ctypes.c_int64, ctypes.c_int]
        self.n = array_bytes // 4
        self.a, self.b, self.c = (torch.full((self.n,), 1.0) for _ in range(3))  # touched: faulted in
        self.threads = torch.get_num_threads()

    def read_once(self) -> float:
        t0 = time.perf_counter()
        self._lib.bw_read(self.b.data_ptr(), self.n, self.threads)
        return self.n * 4 / (time.perf_counter() - t0) / 1e9

    def triad_once(self) -> float:
        t0 = time.perf_counter()
        self._lib.bw_triad(self.a.data_ptr(), self.b.data_ptr(), self.c.data_ptr(), 3.0, self.n, self.threads)
        return 3 * self.n * 4 / (time.perf_counter() - t0) / 1e9

    def measure(self, runs: int = 5) -> Bandwidth:
        """The best of `runs` passes of each, taking turns."""
        reads, triads = [], []
        for _ in range(runs):
            reads.append(self.read_once())
            triads.append(self.triad_once())
        return Bandwidth(max(reads), max(triads), self.threads)

    def close(self) -> None:
        self._tmp.cleanup()


def best(samples: list[Bandwidth]) -> Bandwidth:
    """The ceiling over several measurements (each taken between other work)."""
    return Bandwidth(max(s.read_gbs for s in samples), max(s.triad_gbs for s in samples), samples[0].threads)
