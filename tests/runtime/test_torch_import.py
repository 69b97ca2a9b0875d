"""runtime.torch_import: torch imported with the collector paused, its objects frozen."""

import json
import subprocess
import sys

PROBE = """
import gc, json, sys
gc.disable() if sys.argv[1] == "off" else None
from runtime.torch_import import import_torch
torch = import_torch()
frozen = gc.get_freeze_count()
again = import_torch()
print(json.dumps({"frozen": frozen, "frozen_after_again": gc.get_freeze_count(), "enabled": gc.isenabled(),
                  "same": again is torch and sys.modules["torch"] is torch, "tensor": torch.ones(2).sum().item()}))
"""


def _probe(gc_state: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, gc_state], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_import_is_frozen_and_the_collector_runs_again():
    r = _probe("on")
    assert r["frozen"] > 50_000  # torch's modules, ops and classes: out of every later collection
    assert r["frozen_after_again"] == r["frozen"]  # once per process: a later call freezes nothing new
    assert r["enabled"] and r["same"] and r["tensor"] == 2.0


def test_a_collector_paused_by_the_caller_stays_paused():
    r = _probe("off")
    assert r["frozen"] > 50_000 and not r["enabled"]
