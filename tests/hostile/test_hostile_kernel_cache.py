"""Hostile inputs to the kernel cache (issue 11 items 1, 2, 7, 8): directories we do not own,
symlinks out of the root, special files where entries are expected, oversized records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_util import SPECIAL_KINDS, make_special, no_hang, one_line

from console.cli import main as cli
from store.fingerprint import Key, fingerprint
from store.kernel_cache import (
    CORRUPT,
    MANIFEST,
    MARKER,
    QUARANTINE,
    QUARANTINE_NOTE,
    TRASH,
    Hit,
    KernelCache,
    Miss,
    UntrustedCacheError,
)  # fmt: skip
from store.kernel_cache.inventory import empty_trash, inventory
from store.kernel_cache.quarantine import quarantine

KEY = Key.of({"backend": "export", "source:p": "1", "torch": "2.13.0"})
ART = "program.pt2"


def cached(root: Path) -> KernelCache:
    cache = KernelCache(root)
    cache.publish("prog", KEY, {ART: b"compiled " * 64})
    return cache


def entry(cache: KernelCache) -> Path:
    return cache.layout.base / "prog" / fingerprint(KEY)


def tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def foreign_dir(tmp_path: Path) -> Path:
    """An ordinary directory that happens to hold what a cache root holds."""
    d = tmp_path / "photos"
    for sub in (QUARANTINE + "/holiday", TRASH + "/keep", "v1/prog/album"):
        (d / sub).mkdir(parents=True)
        (d / sub / "precious.jpg").write_bytes(b"\xff\xd8 not ours")
    return d


def test_a_new_root_is_marked_with_the_format_version(tmp_path):
    cache = cached(tmp_path / "programs")
    marker = json.loads((cache.root / MARKER).read_text())
    assert marker["format"] == 1


@pytest.mark.parametrize("command", [["gc", "--max-size", "0"], ["purge", "--all", "--yes"], ["ls"],
                                     ["verify"]])
def test_cache_commands_refuse_an_unmarked_directory_in_one_line_and_delete_nothing(tmp_path, capsys, command):
    d = foreign_dir(tmp_path)
    before = tree(d)
    assert cli(["cache", *command, "--kernel-cache-dir", str(d)]) == 1
    err = capsys.readouterr().err
    assert one_line(err) and "not a kernel cache" in err and str(d) in err
    assert tree(d) == before


def test_lookups_and_builds_refuse_an_unmarked_directory_and_touch_nothing(tmp_path):
    d = foreign_dir(tmp_path)
    before = tree(d)
    cache = KernelCache(d)
    with pytest.raises(UntrustedCacheError, match="not a kernel cache"):
        cache.lookup("prog", KEY)
    with pytest.raises(UntrustedCacheError, match="not a kernel cache"):
        cache.get_or_build("prog", KEY, lambda staging: (staging / ART).write_bytes(b"x"))
    empty_trash(cache.layout)
    assert quarantine(cache.layout, d / "v1" / "prog" / "album", "test") is None
    assert tree(d) == before


def test_an_empty_directory_is_adopted_and_marked(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    cache = cached(root)
    assert (root / MARKER).is_file() and isinstance(cache.lookup("prog", KEY), Hit)


def test_trash_symlinked_out_of_the_root_is_never_followed(tmp_path, capsys):
    cache = cached(tmp_path / "programs")
    outside = tmp_path / "outside"
    (outside / ("a" * 64 + ".deadbeef")).mkdir(parents=True)  # even a name we would produce
    (outside / "precious").write_text("keep")
    os.symlink(outside, cache.root / TRASH)
    empty_trash(cache.layout)
    assert cli(["cache", "purge", "--all", "--yes", "--kernel-cache-dir", str(cache.root)]) == 1
    err = capsys.readouterr().err
    assert one_line(err) and "found a symlink" in err
    assert (outside / "precious").read_text() == "keep" and (outside / ("a" * 64 + ".deadbeef")).is_dir()


def test_trash_and_quarantine_keep_what_our_naming_did_not_produce(tmp_path):
    cache = cached(tmp_path / "programs")
    (cache.root / TRASH / "someone-elses").mkdir(parents=True)
    (cache.root / QUARANTINE / "not-an-entry").mkdir(parents=True)
    (cache.root / QUARANTINE / "not-an-entry" / "data").write_text("keep")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data").write_text("keep")
    os.symlink(outside, cache.root / TRASH / ("b" * 64 + ".cafebabe"))  # a link with our name
    assert cli(["cache", "gc", "--max-size", "0", "--kernel-cache-dir", str(cache.root)]) == 0
    assert (cache.root / TRASH / "someone-elses").is_dir()
    assert (cache.root / QUARANTINE / "not-an-entry" / "data").read_text() == "keep"
    assert (outside / "data").read_text() == "keep"
    assert not entry(cache).exists()  # our own entry was evicted


def test_a_program_dir_symlinked_outside_is_never_purged_through(tmp_path):
    cache = cached(tmp_path / "programs")
    outside = tmp_path / "outside" / ("c" * 64)
    outside.mkdir(parents=True)
    (outside / MANIFEST).write_text("{}")
    os.symlink(tmp_path / "outside", cache.layout.base / "linked")
    assert cli(["cache", "purge", "--all", "--yes", "--kernel-cache-dir", str(cache.root)]) == 0
    assert (outside / MANIFEST).read_text() == "{}"


@pytest.mark.parametrize("kind", SPECIAL_KINDS)
@pytest.mark.parametrize("victim", [MANIFEST, ART])
def test_a_special_file_in_an_entry_is_corrupt_never_a_hang(tmp_path, kind, victim, capsys):
    cache = cached(tmp_path / "programs")
    (entry(cache) / victim).unlink()
    make_special(entry(cache) / victim, kind)
    with no_hang():
        probe = cache.probe("prog", KEY)
        assert isinstance(probe, Miss) and probe.kind == "corrupt"
        [listed] = inventory(cache.layout)
        assert listed.state == CORRUPT
        assert cli(["cache", "verify", "--kernel-cache-dir", str(cache.root)]) == 1
    assert "quarantined prog/" in capsys.readouterr().out


def test_an_oversized_manifest_is_corrupt_without_being_read(tmp_path):
    cache = cached(tmp_path / "programs")
    with open(entry(cache) / MANIFEST, "r+b") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB that would take minutes to read and parse
    [listed] = inventory(cache.layout)
    assert listed.state == CORRUPT and "limit" in listed.reason
    probe = cache.probe("prog", KEY)
    assert isinstance(probe, Miss) and "limit" in probe.reason


def test_an_artifact_larger_than_its_manifest_says_is_refused_before_hashing(tmp_path):
    cache = cached(tmp_path / "programs")
    with open(entry(cache) / ART, "r+b") as f:
        f.truncate(16 << 30)  # sparse: hashing 16 GiB would take a minute
    probe = cache.probe("prog", KEY)
    assert isinstance(probe, Miss) and "manifest says" in probe.reason
    verified = cache.verify()
    assert len(verified.quarantined) == 1


@pytest.mark.parametrize("record", [b"[1, 2]", b"{not json", b'{"when": "yesterday"}', b"x" * (1 << 20),
                                    "fifo"])
def test_a_malformed_quarantine_record_is_one_line_and_keeps_the_listing(tmp_path, record, capsys):
    cache = cached(tmp_path / "programs")
    cache.publish("other", KEY, {ART: b"other"})
    bad = quarantine(cache.layout, entry(cache), "test")
    (bad / QUARANTINE_NOTE).unlink()
    if record == "fifo":
        os.mkfifo(bad / QUARANTINE_NOTE)
    else:
        (bad / QUARANTINE_NOTE).write_bytes(record)
    with no_hang():
        assert cli(["cache", "ls", "--json", "--kernel-cache-dir", str(cache.root)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert sorted(e["program"] for e in listed) == ["other", "prog"]
    [q] = [e for e in listed if e["state"] == "quarantined"]
    assert q["reason"].startswith("quarantined: ") and "\n" not in q["reason"] and len(q["reason"]) < 200


def test_env_var_pointing_at_a_file_is_one_line(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    env = {**os.environ, "DSV4_KERNEL_CACHE_DIR": str(f)}
    for action in (["ls"], ["verify"], ["gc", "--max-size", "1G"], ["why", "prog"]):
        proc = subprocess.run([sys.executable, "-m", "console.cli", "cache", *action], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1 and one_line(proc.stderr) and "not a directory" in proc.stderr, proc.stderr


def test_a_root_owned_by_another_user_is_one_line(tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("needs root to give the directory away")
    cache = cached(tmp_path / "programs")
    os.chown(cache.root, 65534, 65534)
    assert cli(["cache", "ls", "--kernel-cache-dir", str(cache.root)]) == 1
    err = capsys.readouterr().err
    assert one_line(err) and "owned by uid 65534" in err


def test_a_cache_made_before_the_marker_is_adopted_only_when_all_of_it_is_ours(tmp_path, capsys):
    cache = cached(tmp_path / "programs")
    quarantine(cache.layout, entry(cache), "test")
    cache.publish("prog", KEY, {ART: b"again"})
    (cache.root / MARKER).unlink()  # as an older dsv4 left it
    assert cli(["cache", "ls", "--kernel-cache-dir", str(cache.root)]) == 1
    assert "dsv4 cache adopt" in capsys.readouterr().err
    assert cli(["cache", "adopt", "--kernel-cache-dir", str(cache.root)]) == 0
    assert isinstance(cache.lookup("prog", KEY), Hit)


def test_adopt_refuses_a_directory_holding_anything_dsv4_does_not_make(tmp_path, capsys):
    d = foreign_dir(tmp_path)  # quarantine/holiday is not a quarantined entry's name
    before = tree(d)
    assert cli(["cache", "adopt", "--kernel-cache-dir", str(d)]) == 1
    err = capsys.readouterr().err
    assert one_line(err) and "not adopted" in err
    assert tree(d) == before and not (d / MARKER).exists()
