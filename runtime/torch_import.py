"""torch imported with Python's cyclic collector paused, and what the import built frozen.

`import torch` builds a few hundred thousand long-lived objects (modules, op registrations,
dataclasses). The collector, run as they pile up, finds no garbage in them, and once they are
in the oldest generation every full collection walks them all again: a hot `small` registration
on 2 cores spent about 0.25 s in the collector (three full passes of 55-75 ms each, most of
them over torch's own objects), and its process ran 2.99 s where one with this import ran 2.35 s
(a bare `import torch`: 1.79 s, the same run). `gc.freeze()` moves those objects out of every
later collection; the collector still runs, over what this process builds after. Objects frozen
are never collected: whatever garbage the import itself left stays (a one-time cost).
"""

from __future__ import annotations

import gc
import sys
from types import ModuleType


def import_torch() -> ModuleType:
    """torch, imported once per process as the module docstring says; later calls return it."""
    loaded = sys.modules.get("torch")
    if loaded is not None:
        return loaded
    enabled = gc.isenabled()
    gc.disable()
    try:
        import torch
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
    return torch
