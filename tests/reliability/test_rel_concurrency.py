"""Concurrency: 8 processes against one kernel cache root and one sidecar; purge under readers.

The processes are forked from one parent (concworker.py) and released together. Launches use
the eager backend (a cold export of the model's own programs takes most of a minute per
process here); the kernel cache is exercised by three sample programs per process through
`runtime.programs.build.prepare(backend="export")`, each compiled once per key across all 8.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from relcounts import record

from store.kernel_cache.inventory import inventory, remove

WORKER = Path(__file__).with_name("concworker.py")
N = 8


def _run(mode: str, work: Path) -> dict:
    out = work / "result.json"
    proc = subprocess.run([sys.executable, str(WORKER), mode, str(work), str(N), str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1)[:4000])
    return result


def test_eight_processes_prepare_and_launch_at_once_compile_each_key_once(tiny_ckpt_ro, tmp_path,
                                                                          tmp_path_factory):
    shutil.copytree(tiny_ckpt_ro, tmp_path / "ckpt")
    r = _run("launch", tmp_path)
    ok = [c == 0 and res and all(p["correct"] for p in res["programs"].values()) and res["tokens_ok"]
          and res["weights"] == "MAP" for c, res in zip(r["codes"], r["results"], strict=True)]
    record(tmp_path_factory, "concurrency: 8 launches, one cache root + one sidecar",
           injection="8 forked processes released at once: prepare 3 export programs + eager launch",
           trials=N, recovered=sum(ok), data_lost=0 if r["sidecar_unchanged"] else N,
           note=f"compiles per key {r['compiled']}; {r['verified']} entries verified, {r['quarantined']} corrupt")
    assert r["codes"] == [0] * N
    assert all(ok)
    assert r["compiled"] == {"conc_a": 1, "conc_b": 1, "conc_c": 1}
    assert r["states"] == ["current"] * 3 and r["quarantined"] == 0
    assert r["sidecar_unchanged"]


def test_purge_under_readers_is_a_verified_hit_or_a_clean_miss(tmp_path, tmp_path_factory):
    r = _run("purge", tmp_path)
    readers = r["readers"]
    lookups = sum(x["hit"] + x["miss_absent"] + len(x["miss_other"]) for x in readers)
    unclean = [m for x in readers for m in x["miss_other"] if not m.startswith("stale:")]
    wrong = sum(x["wrong_bytes"] for x in readers)
    errors = [e for x in readers for e in x["errors"]]
    record(tmp_path_factory, "concurrency: purge under readers",
           injection=f"{N - 1} reader processes (400 lookups each) vs 1 purger removing and republishing "
                     "4 entries 60 times (new bytes each time)",
           trials=lookups, recovered=sum(x["hit"] for x in readers),
           clean_error=lookups - sum(x["hit"] for x in readers) - len(unclean) - len(errors),
           data_lost=wrong + len(r["quarantined"]),
           note="recovered = verified HIT; clean_error = MISS (absent, or stale: the closest other entry)")
    assert r["codes"] == [0] * N
    assert errors == [] and unclean == [] and wrong == 0
    assert r["quarantined"] == []  # no valid entry was mistaken for a corrupt one
    assert r["final_states"] == ["current"] * 4


def test_entry_replaced_between_manifest_and_artifact_read_is_never_mixed_nor_quarantined(tmp_path):
    """Deterministic form of the race the purge test found: a reader has read generation 0's
    manifest when a purge + republish puts generation 1 (other bytes, same key) in the slot."""
    from store.fingerprint import Key
    from store.kernel_cache import MANIFEST, QUARANTINE, Hit, KernelCache

    cache = KernelCache(tmp_path / "programs")
    key = Key.of({"backend": "export", "source:p": "0", "torch": "2.13.0"})
    cache.publish("prog", key, {"program.pt2": b"generation 0 " * 100})
    new = b"generation 1 " * 100
    original, fired = cache._read, []

    def replace_after_manifest(*args):
        out = original(*args)
        name = args[2]  # (entry, dir fd, name, size cap)
        if name == MANIFEST and not fired:
            fired.append(1)
            remove(cache.layout, [e for e in inventory(cache.layout) if e.program == "prog"])
            cache.publish("prog", key, {"program.pt2": new})
        return out

    cache._read = replace_after_manifest
    got = cache.lookup("prog", key)
    assert fired
    assert isinstance(got, Hit) and got.data("program.pt2") == new
    assert not (tmp_path / "programs" / QUARANTINE).exists() or not any((tmp_path / "programs" / QUARANTINE).iterdir())
