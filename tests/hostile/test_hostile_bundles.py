"""Hostile bundles (issue 34): each refused in one line, exit 1, nothing installed, the receiving
cache exactly as before. The bundles are real tar files, rewritten member by member."""

from __future__ import annotations

import io
import os
import resource
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
from ship_util import export, import_, listing, make_keys, one_line_refusal

from store.fingerprint import Key, fingerprint
from store.kernel_cache import Bundle, EntryBundle, read_bundle, write_bundle
from store.signing import SigningKey, load_signing_key


@pytest.fixture(scope="module")
def good(tmp_path_factory, cold_export_launch, tiny_ckpt_ro):
    where = tmp_path_factory.mktemp("hostile-ship")
    key, trusted = make_keys(where, "builder")
    bundle = where / "good.tar"
    done = export(tiny_ckpt_ro, cold_export_launch[0], bundle, key)
    assert done.returncode == 0, done.stderr
    return bundle, key, trusted


@pytest.fixture
def receiving(tmp_path, good, tiny_ckpt_ro):
    """A receiving cache that already holds one entry, so 'as before' is not merely 'empty'."""
    bundle, _, trusted = good
    dst = tmp_path / "dst"
    parsed = read_bundle(io.BytesIO(bundle.read_bytes()), "x")
    first = tmp_path / "first.tar"
    with open(first, "wb") as f:
        write_bundle(f, Bundle(parsed.host, parsed.created, parsed.entries[:1]))
    assert import_(first, tiny_ckpt_ro, dst, trusted).returncode == 0
    return dst


def members(bundle: Path) -> list[tuple[tarfile.TarInfo, bytes]]:
    with tarfile.open(bundle) as tar:
        return [(m, tar.extractfile(m).read() if m.isreg() else b"") for m in tar.getmembers()]


def rewrite(out: Path, items: list[tuple[tarfile.TarInfo, bytes]]) -> Path:
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for m, data in items:
            tar.addfile(m, io.BytesIO(data) if m.isreg() else None)
    return out


def refused(bundle: Path, dst: Path, model: Path, trusted: Path, *words: str) -> str:
    before = listing(dst)
    line = one_line_refusal(import_(bundle, model, dst, trusted), *words)
    assert listing(dst) == before
    return line


def artifact_member(items) -> int:
    return next(i for i, (m, _) in enumerate(items) if m.name.endswith(".pt2"))


def test_an_artifact_changed_in_the_bundle(good, receiving, tiny_ckpt_ro, tmp_path):
    bundle, _, trusted = good
    items = members(bundle)
    i = artifact_member(items)
    m, data = items[i]
    items[i] = (m, data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, another byte
    refused(rewrite(tmp_path / "bad.tar", items), receiving, tiny_ckpt_ro, trusted, "does not match its sha256")


def test_an_artifact_larger_than_its_manifest_says(good, receiving, tiny_ckpt_ro, tmp_path):
    bundle, _, trusted = good
    items = members(bundle)
    i = artifact_member(items)
    m, data = items[i]
    big = data + b"\0" * (8 << 20)
    m.size = len(big)
    items[i] = (m, big)
    refused(rewrite(tmp_path / "bad.tar", items), receiving, tiny_ckpt_ro, trusted, "its manifest says")


def test_a_signature_by_an_untrusted_key(good, receiving, tiny_ckpt_ro, tmp_path):
    bundle, _, trusted = good
    stranger, _ = make_keys(tmp_path, "stranger")
    resigned = resign(bundle, load_signing_key(stranger), tmp_path / "bad.tar")
    line = refused(resigned, receiving, tiny_ckpt_ro, trusted, "not trusted")
    assert load_signing_key(stranger).public.id in line


def test_no_signature(good, receiving, tiny_ckpt_ro, tmp_path):
    bundle, _, trusted = good
    items = [(m, d) for m, d in members(bundle) if not m.name.endswith("/signature.json")]
    refused(rewrite(tmp_path / "bad.tar", items), receiving, tiny_ckpt_ro, trusted, "unsigned")


def test_a_valid_signature_over_a_different_entry(good, receiving, tiny_ckpt_ro, tmp_path):
    bundle, _, trusted = good
    items = members(bundle)
    sigs = [i for i, (m, _) in enumerate(items) if m.name.endswith("/signature.json")]
    assert len(sigs) >= 2
    (m0, d0), (m1, d1) = items[sigs[0]], items[sigs[1]]
    m0.size, m1.size = len(d1), len(d0)
    items[sigs[0]], items[sigs[1]] = (m0, d1), (m1, d0)  # each entry carries the other's signature
    refused(rewrite(tmp_path / "bad.tar", items), receiving, tiny_ckpt_ro, trusted, "is not over this entry")


@pytest.mark.parametrize("component", ["torch", "device.cpu", "source:"])
def test_a_key_for_another_torch_capability_or_source(good, receiving, tiny_ckpt_ro, tmp_path, component):
    bundle, key, trusted = good
    parsed = read_bundle(io.BytesIO(bundle.read_bytes()), "x")
    e = parsed.entries[0]
    components = e.manifest.key.as_dict()
    if component == "source:":  # one unit of the program's source, as another checkout hashes it
        component = next(n for n in components if n.startswith("source:"))
        value = "0" * len(str(components[component]))
    else:
        value = "9.9.9" if component == "torch" else {"machine": "riscv64", "flags": []}
    assert components[component] != value
    changed = Key.of({**components, component: value})
    manifest = replace(e.manifest, key=changed, fingerprint=fingerprint(changed))
    signed = EntryBundle(manifest, e.contents).signed(load_signing_key(key))  # by the trusted key
    out = tmp_path / "other.tar"
    with open(out, "wb") as f:
        write_bundle(f, Bundle(parsed.host, parsed.created, (signed,)))
    refused(out, receiving, tiny_ckpt_ro, trusted, f"built for another {component}", "can never load it")


def resign(bundle: Path, key: SigningKey, out: Path) -> Path:
    parsed = read_bundle(io.BytesIO(bundle.read_bytes()), "x")
    with open(out, "wb") as f:
        write_bundle(f, Bundle(parsed.host, parsed.created, tuple(e.signed(key) for e in parsed.entries)))
    return out


def _hostile_member(kind: str, items) -> tarfile.TarInfo:
    entry_dir = items[1][0].name.rsplit("/", 1)[0]  # the first entry's dir: listed in the index
    m = tarfile.TarInfo(f"{entry_dir}/evil")
    if kind == "dotdot":
        m.name = f"{entry_dir}/../../../../etc/evil"
    elif kind == "absolute":
        m.name = "/etc/evil"
    elif kind == "symlink":
        m.type, m.linkname = tarfile.SYMTYPE, "/etc/passwd"
    elif kind == "hardlink":
        m.type, m.linkname = tarfile.LNKTYPE, items[0][0].name
    elif kind == "device":
        m.type, m.devmajor, m.devminor = tarfile.CHRTYPE, 1, 3
    elif kind == "fifo":
        m.type = tarfile.FIFOTYPE
    return m


@pytest.mark.parametrize("kind,words", [
    ("dotdot", "'..'"), ("absolute", "absolute path"), ("symlink", "a symlink"), ("hardlink", "a hard link"),
    ("device", "a character device"), ("fifo", "a FIFO"),
])  # fmt: skip
def test_an_unsafe_member_in_the_archive(good, receiving, tiny_ckpt_ro, tmp_path, kind, words):
    bundle, _, trusted = good
    items = members(bundle)
    items.insert(len(items) // 2, (_hostile_member(kind, items), b""))
    refused(rewrite(tmp_path / "bad.tar", items), receiving, tiny_ckpt_ro, trusted, words)
    assert not Path("/etc/evil").exists()


@pytest.mark.parametrize("cut", [0.5, "boundary", 100])
def test_a_truncated_bundle(good, receiving, tiny_ckpt_ro, tmp_path, cut):
    bundle, _, trusted = good
    raw = bundle.read_bytes()
    if cut == "boundary":  # cut exactly after a member: tar alone cannot tell
        items = members(bundle)
        short = rewrite(tmp_path / "short.tar", items[: len(items) // 2])
        raw = short.read_bytes()
    else:
        raw = raw[: int(len(raw) * cut)] if isinstance(cut, float) else raw[:cut]
    bad = tmp_path / "bad.tar"
    bad.write_bytes(raw)
    refused(bad, receiving, tiny_ckpt_ro, trusted, "truncated")


def test_a_cache_that_cannot_take_the_entries_installs_none_of_them(good, receiving, tiny_ckpt_ro, tmp_path):
    """A file-size limit below the largest artifact: a write fails half-way through the import (as
    a full disk does): one line, and none of the entries is installed, those staged before it too.
    The receiving cache keeps every file as it was."""
    bundle, _, trusted = good
    sizes = [f.size for e in read_bundle(io.BytesIO(bundle.read_bytes()), "x").entries for f in e.manifest.files]
    limit = max(sizes) - 1
    assert limit > 64 << 10 and sorted(sizes)[0] <= limit  # room for the small files and some artifacts

    def small_files():  # SIGXFSZ is ignored by Python: a write past the limit is OSError(EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    before = listing(receiving)
    done = import_(bundle, tiny_ckpt_ro, receiving, trusted, preexec_fn=small_files)
    line = one_line_refusal(done, f"kernel cache {receiving}", "File too large", "nothing was installed")
    after = listing(receiving)
    assert [x for x in after if x[1] >= 0] == [x for x in before if x[1] >= 0], line  # every file as it was
    # the program dirs the staging went in stay, empty (as any writer makes them); no staging dir is left
    assert all(path.startswith("v1/") and path.count("/") == 1 for path, _ in set(after) - set(before))


def test_not_a_tar_at_all(good, receiving, tiny_ckpt_ro, tmp_path):
    _, _, trusted = good
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"\x89PNG not a bundle" * 100)
    refused(bad, receiving, tiny_ckpt_ro, trusted, "bad.tar")


def test_a_fifo_as_the_bundle_never_blocks(good, receiving, tiny_ckpt_ro, tmp_path):
    _, _, trusted = good
    fifo = tmp_path / "bundle.tar"
    os.mkfifo(fifo)
    refused(fifo, receiving, tiny_ckpt_ro, trusted, "not a regular file")
