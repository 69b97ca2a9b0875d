"""Kernel cache: round trip, MISS reasons, corruption, trust, concurrency, crashes.

Torch-free: keys are data and artifacts are bytes here; tests/runtime/programs/test_build.py compiles.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kernel_cache_samples import ART, PAYLOAD, WORKER, entry_dir, make_key, put, quarantined
from kernel_cache_samples import cache as cache  # a fixture

from console.cli import main as cli
from runtime.programs.spec import CONFIG_COMPONENTS
from store.fingerprint import UNKNOWN, Key, fingerprint
from store.kernel_cache import (
    CURRENT,
    MANIFEST,
    PARTIAL,
    QUARANTINED,
    Hit,
    KernelCache,
    Miss,
    UntrustedCacheError,
)
from store.kernel_cache.inventory import inventory

# ---------------------------------------------------------------------------------------------
# Round trip and MISS reasons


def test_round_trip_returns_the_verified_bytes_and_records_the_key(cache):
    key = make_key()
    put(cache, key)
    hit = cache.lookup("layer", key)
    assert isinstance(hit, Hit)
    assert hit.data(ART) == PAYLOAD
    manifest = json.loads((entry_dir(cache, key) / MANIFEST).read_text())
    assert Key.from_json(manifest["key"]) == key
    assert manifest["files"][0]["size"] == len(PAYLOAD)
    assert manifest["pid"] == os.getpid() and manifest["format"] == 1
    # only the configuration components the key has are recorded (the key here has no captures)
    assert manifest["config_components"] == [c for c in CONFIG_COMPONENTS if c in key.as_dict()]


def test_several_fingerprints_of_one_program_coexist(cache):
    a, b = make_key(layout={"tp": 1}), make_key(layout={"tp": 2})
    put(cache, a, data=b"a")
    put(cache, b, data=b"b")
    assert cache.lookup("layer", a).data(ART) == b"a"
    assert cache.lookup("layer", b).data(ART) == b"b"


def test_empty_cache_misses_as_not_cached(cache):
    miss = cache.lookup("layer", make_key())
    assert isinstance(miss, Miss) and miss.kind == "absent" and miss.reason == "not cached"


@pytest.mark.parametrize(
    ("component", "value", "kind"),
    [
        ("torch", "2.14.1", "stale"),
        ("torch.git", "0123abcd", "stale"),
        ("compiler", "clang version 19.1.0", "stale"),
        ("device.cpu", {"machine": "x86_64", "flags": ["avx512f"]}, "stale"),
        ("env", {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}, "stale"),
        ("source:model.layer", "2222bbbb", "stale"),
        ("layout", {"tp": 8}, "absent"),
        ("model_dims", {"hidden": 16}, "absent"),
        ("backend", "aoti", "absent"),
    ],
)
def test_miss_names_the_component_that_differs(cache, component, value, kind):
    put(cache, make_key())
    miss = cache.lookup("layer", make_key(**{component: value}))
    assert isinstance(miss, Miss)
    assert miss.kind == kind
    assert component in miss.reason
    assert [c.component for c in miss.changes] == [component]


def test_stale_entry_says_what_changed_in_words(cache):
    put(cache, make_key(torch="2.13.0"))
    miss = cache.lookup("layer", make_key(torch="2.14.1"))
    assert "torch is 2.13.0 here; this launch uses 2.14.1" in miss.reason


def test_unknown_component_never_stores_nor_hits(cache):
    key = make_key(compiler=UNKNOWN)
    assert isinstance(cache.lookup("layer", key), Miss)
    with pytest.raises(ValueError, match="unknown"):
        put(cache, key)
    built = []
    fetch = cache.get_or_build("layer", key, lambda d: built.append((d / ART).write_bytes(PAYLOAD)))
    assert built and fetch.built and fetch.hit.path is None and fetch.hit.data(ART) == PAYLOAD
    assert fetch.miss.kind == "unknown" and "compiler" in fetch.miss.reason
    assert not (cache.root / "v1" / "layer").exists() or not any((cache.root / "v1" / "layer").iterdir())


def test_get_or_build_builds_once_then_hits(cache):
    calls = []

    def build(d: Path) -> None:
        calls.append(1)
        (d / ART).write_bytes(PAYLOAD)

    first = cache.get_or_build("layer", make_key(), build)
    second = cache.get_or_build("layer", make_key(), build)
    assert (first.built, second.built) == (True, False)
    assert second.hit.data(ART) == PAYLOAD and len(calls) == 1
    assert first.miss.reason == "not cached" and second.miss is None


# ---------------------------------------------------------------------------------------------
# Corruption: MISS + quarantine, never an exception


def _truncate(entry: Path) -> None:
    (entry / ART).write_bytes(PAYLOAD[:10])


def _flip_byte(entry: Path) -> None:
    data = bytearray((entry / ART).read_bytes())
    data[len(data) // 2] ^= 0x01
    (entry / ART).write_bytes(bytes(data))


def _remove_artifact(entry: Path) -> None:
    (entry / ART).unlink()


def _malform_manifest(entry: Path) -> None:
    (entry / MANIFEST).write_text('{"format": 1, "program": ')


def _mismatch_manifest_key(entry: Path) -> None:
    manifest = json.loads((entry / MANIFEST).read_text())
    manifest["key"] = make_key(torch="9.9.9").to_json()
    (entry / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage", [_truncate, _flip_byte, _remove_artifact, _malform_manifest, _mismatch_manifest_key]
)
def test_corrupt_entry_misses_and_is_quarantined(cache, damage):
    key = make_key()
    put(cache, key)
    damage(entry_dir(cache, key))
    miss = cache.lookup("layer", key)
    assert isinstance(miss, Miss) and miss.kind == "corrupt"
    assert not entry_dir(cache, key).exists()
    assert len(quarantined(cache)) == 1
    [listed] = [e for e in inventory(cache.layout) if e.state == QUARANTINED]
    assert listed.reason.startswith("quarantined: corrupt")
    rebuilt = cache.get_or_build("layer", key, lambda d: (d / ART).write_bytes(PAYLOAD))
    assert rebuilt.built and rebuilt.hit.path == entry_dir(cache, key)


def test_verify_quarantines_what_ls_cannot_see(cache):
    good, bad = make_key(layout={"tp": 1}), make_key(layout={"tp": 2})
    put(cache, good)
    put(cache, bad)
    _flip_byte(entry_dir(cache, bad))  # same size: only hashing finds it
    assert {e.state for e in inventory(cache.layout)} == {CURRENT}
    result = cache.verify()
    assert result.checked == 2
    [found] = result.quarantined
    assert found.fingerprint == fingerprint(bad) and "sha256" in found.reason
    assert isinstance(cache.lookup("layer", good), Hit)


def test_staging_dirs_are_invisible_to_readers(cache):
    key = make_key()
    put(cache, key)
    entry = entry_dir(cache, key)
    staging = entry.with_name(f".tmp-{entry.name[:16]}.somehost.12345.abcdef01")
    entry.rename(staging)  # a complete entry, but under a staging name
    miss = cache.lookup("layer", key)
    assert isinstance(miss, Miss) and miss.kind == "absent"
    assert [e.state for e in inventory(cache.layout)] == [PARTIAL]


# ---------------------------------------------------------------------------------------------
# Processes


def _racers(tmp_path: Path, mode: str, n: int) -> list[dict]:
    root, go = tmp_path / "programs", tmp_path / "go"
    outs = [tmp_path / f"out{i}.json" for i in range(n)]
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(root), mode, str(o), str(go)])
        for o in outs
    ]
    go.touch()
    assert [p.wait(timeout=120) for p in procs] == [0] * n
    return [json.loads(o.read_text()) for o in outs]


def _visible_entries(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "v1" / "racer").iterdir() if not p.name.startswith("."))


def test_eight_processes_one_key_compile_once_with_the_lock(tmp_path):
    results = _racers(tmp_path, "lock", 8)
    assert all(r["verified"] and r["published"] for r in results)
    assert sum(r["built"] for r in results) == 1
    assert len(_visible_entries(tmp_path / "programs")) == 1
    assert [e.state for e in inventory(KernelCache(tmp_path / "programs").layout)] == [CURRENT]


def test_eight_processes_stay_correct_without_the_lock(tmp_path):
    results = _racers(tmp_path, "nolock", 8)
    assert all(r["verified"] for r in results)
    assert len(_visible_entries(tmp_path / "programs")) == 1
    # losers discarded their staging dirs: nothing partial is left behind
    assert [e.state for e in inventory(KernelCache(tmp_path / "programs").layout)] == [CURRENT]


def test_sigkill_mid_publish_leaves_no_visible_entry(tmp_path):
    root, marker, go = tmp_path / "programs", tmp_path / "staged", tmp_path / "go"
    go.touch()
    proc = subprocess.Popen([sys.executable, str(WORKER), str(root), "kill", str(marker), str(go)])
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)

    cache = KernelCache(root)
    sys.path.insert(0, str(WORKER.parent))
    from worker_kernel_cache import PAYLOAD, key

    assert isinstance(cache.lookup("racer", key()), Miss)
    assert _visible_entries(root) == []
    [partial] = inventory(cache.layout)
    assert partial.state == PARTIAL and "writer gone" in partial.reason and not partial.busy
    # the next writer sweeps the dead writer's staging dir and publishes normally
    fetch = cache.get_or_build("racer", key(), lambda d: (d / ART).write_bytes(PAYLOAD))
    assert fetch.built and [e.state for e in inventory(cache.layout)] == [CURRENT]


# ---------------------------------------------------------------------------------------------
# Trust and modes


def test_world_writable_root_is_refused_with_the_fix(cache):
    put(cache, make_key())
    os.chmod(cache.root, 0o777)
    with pytest.raises(UntrustedCacheError) as err:
        cache.lookup("layer", make_key())
    message = str(err.value)
    assert str(cache.root) in message and "chmod go-w" in message and "\n" not in message
    assert cli(["cache", "verify", "--kernel-cache-dir", str(cache.root)]) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give the root to another user")
def test_root_owned_by_another_user_is_refused(cache):
    put(cache, make_key())
    os.chown(cache.root, 4242, 4242)
    with pytest.raises(UntrustedCacheError, match="owned by uid 4242"):
        cache.lookup("layer", make_key())


def test_artifact_symlinked_outside_the_root_is_refused_and_quarantined(cache, tmp_path):
    key = make_key()
    put(cache, key)
    outside = tmp_path / "elsewhere.pt2"
    outside.write_bytes(PAYLOAD)  # same bytes: only the symlink is wrong
    artifact = entry_dir(cache, key) / ART
    artifact.unlink()
    artifact.symlink_to(outside)
    miss = cache.lookup("layer", key)
    assert isinstance(miss, Miss) and miss.kind == "untrusted" and "outside the cache root" in miss.reason
    assert len(quarantined(cache)) == 1


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_published_files_are_readable_and_never_group_writable(cache, umask):
    old = os.umask(umask)
    try:
        put(cache, make_key())
    finally:
        os.umask(old)
    entry = entry_dir(cache, make_key())
    for path in (entry / ART, entry / MANIFEST):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
    for d in (cache.root, cache.root / "v1", entry.parent, entry):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755
    assert isinstance(cache.lookup("layer", make_key()), Hit)  # our own entries stay trusted
