"""The thread that registered lets its OpenMP workers go before the engine thread steps
(runtime.serve.openmp): in a process of its own, its team's workers exit."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

SCRIPT = """
import json, os, threading, torch
from runtime.serve.openmp import loaded_runtimes, release_this_threads_team

def tasks():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(2)
x = torch.randn(1 << 22)
(x * 2 + 1).sum()  # a parallel region: this thread's team of 2 (itself and one worker)
before = tasks()
released = release_this_threads_team()
after = tasks()
got = []  # another thread's regions still run, on a team of its own
t = threading.Thread(target=lambda: got.append(float((x * 0 + 1).sum())))
t.start(); t.join()
print(json.dumps({"runtimes": loaded_runtimes(), "released": released, "before": before, "after": after,
                  "other": got}))
"""


def test_releasing_the_main_threads_team_ends_its_workers_and_others_still_compute():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         cwd=REPO, check=True)
    r = json.loads(out.stdout.splitlines()[-1])
    assert any("gomp" in p for p in r["runtimes"])  # torch's Linux wheels bring libgomp
    assert r["released"] >= 1
    assert r["after"] < r["before"]  # the worker thread ended
    assert r["other"] == [float(1 << 22)]
