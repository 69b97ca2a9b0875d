"""Kernel cache as an operator sees it: ls states, hits, gc, purge, why, structural probes, the
byte count of verification, quarantined entries.

Torch-free: keys are data and artifacts are bytes here; tests/runtime/programs/test_build.py compiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kernel_cache_samples import ART, PAYLOAD, WORKER, entry_dir, make_key, put, quarantined
from kernel_cache_samples import cache as cache  # a fixture

from console.cli import main as cli
from runtime.toolchain import toolchain_components
from store.fingerprint import UNKNOWN, fingerprint
from store.kernel_cache import (
    CORRUPT,
    CURRENT,
    MANIFEST,
    OTHER_LAYOUT,
    PARTIAL,
    QUARANTINED,
    STALE,
    Hit,
    KernelCache,
    Miss,
    Reference,
)
from store.kernel_cache.inventory import gc, inventory
from store.kernel_cache.quarantine import quarantine

# ---------------------------------------------------------------------------------------------
# Inventory, stats, purge, gc


def test_ls_states_on_a_prepared_cache(cache):
    live = make_key()
    put(cache, live)
    put(cache, make_key(layout={"tp": 2}))
    put(cache, make_key(torch="2.12.0"))
    broken = make_key(model_dims={"hidden": 16})
    put(cache, broken)
    (entry_dir(cache, broken) / ART).write_bytes(b"short")
    staging = cache.root / "v1" / "layer" / ".tmp-0123456789abcdef.otherhost.1.abcdef01"
    staging.mkdir()
    put(cache, make_key(torch="2.12.0"), program="unlisted")
    put(cache, make_key(), program="unlisted")

    reference = Reference(components=dict(toolchain_components("cpu")), keys={"layer": live})
    states = {(e.program, e.state): e for e in inventory(cache.layout, reference)}
    assert set(states) == {
        ("layer", CURRENT),
        ("layer", OTHER_LAYOUT),
        ("layer", STALE),
        ("layer", CORRUPT),
        ("layer", PARTIAL),
        ("unlisted", STALE),
        ("unlisted", CURRENT),
    }
    assert "layout" in states["layer", OTHER_LAYOUT].reason
    assert "torch is 2.12.0 here; this launch uses 2.13" in states["layer", STALE].reason
    assert "short" not in states["layer", CORRUPT].reason and "bytes" in states["layer", CORRUPT].reason
    assert "age" in states["layer", PARTIAL].reason and states["layer", PARTIAL].busy
    assert "no live key" in states["unlisted", CURRENT].reason


def test_hits_and_last_use_are_recorded_without_touching_the_manifest(cache):
    key = make_key()
    put(cache, key)
    manifest = entry_dir(cache, key) / MANIFEST
    before = manifest.read_bytes(), manifest.stat().st_mtime_ns
    for _ in range(3):
        cache.lookup("layer", key)
    [entry] = inventory(cache.layout)
    assert entry.hits == 3 and entry.last_used >= entry.created
    assert (manifest.read_bytes(), manifest.stat().st_mtime_ns) == before


def test_gc_evicts_least_recently_used_first(cache):
    keys = [make_key(layout={"tp": n}) for n in (1, 2, 3)]
    for n, key in enumerate(keys):
        put(cache, key)
        cache.lookup("layer", key)
        stamp = entry_dir(cache, key) / ".hits"
        os.utime(stamp, (1_000_000 + n, 1_000_000 + n))  # keys[0] used longest ago
    newest = {fingerprint(k) for k in keys[1:]}
    removed = gc(cache.layout, max_size=sum(e.size_bytes for e in inventory(cache.layout) if e.fingerprint in newest))
    assert [e.fingerprint for e in removed] == [fingerprint(keys[0])]
    assert {e.fingerprint for e in inventory(cache.layout)} == {fingerprint(k) for k in keys[1:]}


def test_purge_stale_keeps_current_entries(cache, capsys):
    put(cache, make_key())
    put(cache, make_key(torch="2.12.0"))
    root = str(cache.root)
    assert cli(["cache", "purge", "--stale", "--dry-run", "--kernel-cache-dir", root]) == 0
    assert len(inventory(cache.layout)) == 2
    assert cli(["cache", "purge", "--stale", "--yes", "--kernel-cache-dir", root]) == 0
    assert [e.state for e in inventory(cache.layout, Reference(dict(toolchain_components("cpu"))))] == [CURRENT]
    assert "deleted 1 entries" in capsys.readouterr().out


def test_purge_without_yes_on_a_pipe_refuses_in_one_line(cache, capsys, monkeypatch):
    put(cache, make_key())
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert cli(["cache", "purge", "--all", "--kernel-cache-dir", str(cache.root)]) == 1
    assert "pass --yes" in capsys.readouterr().err
    assert len(inventory(cache.layout)) == 1


def test_cache_ls_json_lists_states(cache, capsys):
    put(cache, make_key())
    put(cache, make_key(torch="2.12.0"))
    assert cli(["cache", "ls", "--json", "--kernel-cache-dir", str(cache.root)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["state"] for r in rows) == [CURRENT, STALE]
    assert {"program", "fingerprint", "state", "reason", "size_bytes"} <= set(rows[0])


def test_cache_ls_uses_the_env_cache_dir_and_imports_no_torch(tmp_path):
    root = tmp_path / "env-cache"
    put(KernelCache(root), make_key())
    code = (
        "import sys; from console.cli import main; rc = main(['cache', 'ls']);"
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    env = {**os.environ, "DSV4_KERNEL_CACHE_DIR": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=WORKER.parents[1], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "1 entries" in out.stdout and "current" in out.stdout


def test_why_names_what_differs_for_each_entry(cache, capsys):
    put(cache, make_key(torch="2.12.0"))
    assert cli(["cache", "why", "layer", "--kernel-cache-dir", str(cache.root)]) == 1
    out = capsys.readouterr().out
    assert "no live key" in out and "stale: torch is 2.12.0 here; this launch uses" in out


def test_purge_one_program_and_gc_from_the_cli(cache, capsys):
    put(cache, make_key(), program="keep")
    put(cache, make_key(), program="drop")
    root = str(cache.root)
    assert cli(["cache", "purge", "--program", "drop", "--yes", "--kernel-cache-dir", root]) == 0
    assert [e.program for e in inventory(cache.layout)] == ["keep"]
    assert cli(["cache", "gc", "--max-size", "lots", "--kernel-cache-dir", root]) == 1
    assert "not a size" in capsys.readouterr().err
    assert cli(["cache", "gc", "--max-size", "0", "--kernel-cache-dir", root]) == 0
    assert inventory(cache.layout) == []


def test_probe_without_verify_checks_structure_and_reads_no_artifact(cache):
    key = make_key()
    put(cache, key)
    quick = cache.probe("layer", key, verify=False)
    assert isinstance(quick, Hit) and quick.contents == {} and quick.path == entry_dir(cache, key)
    art = entry_dir(cache, key) / ART
    data = bytearray(art.read_bytes())
    data[0] ^= 0xFF
    art.write_bytes(bytes(data))  # same size: only hashing sees it
    assert cache.probe("layer", key, verify=False).hit
    assert cache.probe("layer", key).kind == "corrupt"
    art.write_bytes(bytes(data) + b"x")  # a size the manifest does not record
    miss = cache.probe("layer", key, verify=False)
    assert isinstance(miss, Miss) and "manifest says" in miss.reason
    assert isinstance(cache.probe("layer", make_key(backend="aoti"), verify=False), Miss)


# ---------------------------------------------------------------------------------------------
# Verified bytes, probed hits, quarantined entries


def test_verified_bytes_count_what_a_probe_hashed_and_a_structural_probe_hashes_nothing(cache):
    key = make_key()
    put(cache, key, data=PAYLOAD)
    put(cache, key, program="other", data=b"other bytes")
    reader = KernelCache(cache.root)
    assert reader.verified_bytes == 0
    hit = reader.probe("layer", key)
    assert isinstance(hit, Hit)
    assert reader.verified_bytes == sum(f.size for f in hit.manifest.files) == len(PAYLOAD)
    assert reader.probe("other", key, verify=False).hit
    assert reader.verified_bytes == len(PAYLOAD)
    reader.verify()  # hashes every entry again
    assert reader.verified_bytes == 2 * len(PAYLOAD) + len(b"other bytes")


def test_record_hit_counts_a_probed_hit_as_a_lookup_would(cache):
    key = make_key()
    put(cache, key)
    hit = cache.probe("layer", key)
    assert [e.hits for e in inventory(cache.layout)] == [0]  # a probe records nothing
    cache.record_hit(hit)
    cache.lookup("layer", key)
    assert [e.hits for e in inventory(cache.layout)] == [2]
    built = cache.get_or_build("layer", make_key(compiler=UNKNOWN), lambda d: (d / ART).write_bytes(b"x"))
    cache.record_hit(built.hit)  # never published: nothing to count
    assert [e.hits for e in inventory(cache.layout)] == [2]


def test_a_quarantined_entry_is_listed_quarantined_and_gc_removes_it(cache, capsys):
    key = make_key()
    put(cache, key)
    put(cache, key, program="kept")
    quarantine(cache.layout, entry_dir(cache, key), "load failed: test")
    [q] = [e for e in inventory(cache.layout) if e.program == "layer"]
    assert q.state == QUARANTINED and q.reason == "quarantined: load failed: test"
    assert q.to_json()["state"] == "quarantined"
    assert cli(["cache", "purge", "--corrupt", "--dry-run", "--kernel-cache-dir", str(cache.root)]) == 0
    assert "would delete layer/" in capsys.readouterr().out
    removed = gc(cache.layout, max_size=1 << 30)
    assert [e.state for e in removed] == [QUARANTINED]
    assert quarantined(cache) == [] and [e.program for e in inventory(cache.layout)] == ["kept"]
