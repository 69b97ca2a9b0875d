"""Program cache: round trip, MISS reasons, corruption, trust, concurrency, crashes, inventory.

Torch-free: keys are data and artifacts are bytes here; tests/test_programs.py compiles.
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

from console.cli import main as cli
from runtime.program_spec import CONFIG_COMPONENTS
from runtime.toolchain import toolchain_components
from store.fingerprint import UNKNOWN, Key, fingerprint
from store.kernel_cache import (
    CORRUPT,
    CURRENT,
    MANIFEST,
    OTHER_LAYOUT,
    PARTIAL,
    QUARANTINE,
    STALE,
    Hit,
    KernelCache,
    Miss,
    Reference,
    UntrustedCacheError,
)

WORKER = Path(__file__).with_name("worker_kernel_cache.py")
ART = "program.pt2"
PAYLOAD = b"\x7fELF pretend this is a compiled program" * 64


def make_key(**changes) -> Key:
    components = {
        "backend": "export",
        "device": "cpu",
        "signature": {"inputs": [{"name": "x", "dtype": "float32", "shape": ["tokens", 8]}]},
        "layout": {"tp": 1},
        "model_dims": {"hidden": 8},
        "source:model.layer": "1111aaaa",
        **dict(toolchain_components("cpu")),
    }
    components.update(changes)
    return Key.of(components)


def put(cache: KernelCache, key: Key, program: str = "layer", data: bytes = PAYLOAD) -> Hit:
    return cache.publish(program, key, {ART: data}, config_components=CONFIG_COMPONENTS)


def entry_dir(cache: KernelCache, key: Key, program: str = "layer") -> Path:
    return cache.root / "v1" / program / fingerprint(key)


def quarantined(cache: KernelCache) -> list[Path]:
    q = cache.root / QUARANTINE
    return sorted(q.iterdir()) if q.exists() else []


@pytest.fixture
def cache(tmp_path) -> KernelCache:
    return KernelCache(tmp_path / "programs")


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
    assert "torch 2.13.0 → 2.14.1" in miss.reason


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
    [listed] = [e for e in cache.inventory() if e.state == CORRUPT]
    assert listed.reason.startswith("quarantined: corrupt")
    rebuilt = cache.get_or_build("layer", key, lambda d: (d / ART).write_bytes(PAYLOAD))
    assert rebuilt.built and rebuilt.hit.path == entry_dir(cache, key)


def test_verify_quarantines_what_ls_cannot_see(cache):
    good, bad = make_key(layout={"tp": 1}), make_key(layout={"tp": 2})
    put(cache, good)
    put(cache, bad)
    _flip_byte(entry_dir(cache, bad))  # same size: only hashing finds it
    assert {e.state for e in cache.inventory()} == {CURRENT}
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
    assert [e.state for e in cache.inventory()] == [PARTIAL]


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
    assert [e.state for e in KernelCache(tmp_path / "programs").inventory()] == [CURRENT]


def test_eight_processes_stay_correct_without_the_lock(tmp_path):
    results = _racers(tmp_path, "nolock", 8)
    assert all(r["verified"] for r in results)
    assert len(_visible_entries(tmp_path / "programs")) == 1
    # losers discarded their staging dirs: nothing partial is left behind
    assert [e.state for e in KernelCache(tmp_path / "programs").inventory()] == [CURRENT]


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
    [partial] = cache.inventory()
    assert partial.state == PARTIAL and "writer gone" in partial.reason and not partial.busy
    # the next writer sweeps the dead writer's staging dir and publishes normally
    fetch = cache.get_or_build("racer", key(), lambda d: (d / ART).write_bytes(PAYLOAD))
    assert fetch.built and [e.state for e in cache.inventory()] == [CURRENT]


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
    states = {(e.program, e.state): e for e in cache.inventory(reference)}
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
    assert "torch 2.12.0 → 2.13" in states["layer", STALE].reason
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
    [entry] = cache.inventory()
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
    removed = cache.gc(max_size=sum(e.size_bytes for e in cache.inventory() if e.fingerprint in newest))
    assert [e.fingerprint for e in removed] == [fingerprint(keys[0])]
    assert {e.fingerprint for e in cache.inventory()} == {fingerprint(k) for k in keys[1:]}


def test_purge_stale_keeps_current_entries(cache, capsys):
    put(cache, make_key())
    put(cache, make_key(torch="2.12.0"))
    root = str(cache.root)
    assert cli(["cache", "purge", "--stale", "--dry-run", "--kernel-cache-dir", root]) == 0
    assert len(cache.inventory()) == 2
    assert cli(["cache", "purge", "--stale", "--yes", "--kernel-cache-dir", root]) == 0
    assert [e.state for e in cache.inventory(Reference(dict(toolchain_components("cpu"))))] == [CURRENT]
    assert "deleted 1 entries" in capsys.readouterr().out


def test_purge_without_yes_on_a_pipe_refuses_in_one_line(cache, capsys, monkeypatch):
    put(cache, make_key())
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert cli(["cache", "purge", "--all", "--kernel-cache-dir", str(cache.root)]) == 1
    assert "pass --yes" in capsys.readouterr().err
    assert len(cache.inventory()) == 1


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
    assert "no live key" in out and "stale: torch 2.12.0" in out


def test_purge_one_program_and_gc_from_the_cli(cache, capsys):
    put(cache, make_key(), program="keep")
    put(cache, make_key(), program="drop")
    root = str(cache.root)
    assert cli(["cache", "purge", "--program", "drop", "--yes", "--kernel-cache-dir", root]) == 0
    assert [e.program for e in cache.inventory()] == ["keep"]
    assert cli(["cache", "gc", "--max-size", "lots", "--kernel-cache-dir", root]) == 1
    assert "not a size" in capsys.readouterr().err
    assert cli(["cache", "gc", "--max-size", "0", "--kernel-cache-dir", root]) == 0
    assert cache.inventory() == []


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
