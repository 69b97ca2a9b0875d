"""Letting go of a thread's OpenMP workers, so that one team of them serves the engine.

An OpenMP runtime keeps a team of worker threads for each thread that ran a parallel region
(torch's CPU ops, and every kernel an aoti program holds, run as such regions). libgomp's
workers spin between regions, which is what makes a step of many small kernels fast; but once
the workers of all teams outnumber the CPUs, it throttles every spin to a few iterations, and
each region then wakes its workers through the kernel. A service registers in its main thread
and steps in its engine thread: two teams on two cores made an aoti decode step of `tiny` 12×
slower in the service than the same step in the thread that registered (15.4 against 1.2 ms).
Released in the main thread before the engine thread steps (`omp_pause_resource_all`, OpenMP
5.0), the main thread's team exits and the engine thread's is the only one.
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # the runtime's threads end; it starts them again when a region needs them
RUNTIMES = ("libgomp", "libiomp5", "libomp")  # GNU (torch's Linux wheels), Intel, LLVM


def loaded_runtimes() -> list[str]:
    """The OpenMP runtimes mapped into this process (torch loads its own)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line}
    except OSError:  # not Linux: nothing to release here
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(RUNTIMES))


def release_this_threads_team() -> int:
    """End the OpenMP workers of the calling thread's team, in every runtime loaded; the next
    parallel region this thread runs starts a new team. Call it only where this thread runs no
    region at the time (it is this thread's own team). Returns how many runtimes released it."""
    released = 0
    for path in loaded_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # a runtime older than OpenMP 5.0
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(OMP_PAUSE_SOFT) == 0:
            released += 1
        else:
            log.debug("%s: omp_pause_resource_all refused", path)
    return released
