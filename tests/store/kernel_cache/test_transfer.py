"""Kernel-cache entries that travel by file: keys, export, import, the origin kept (issue 34)."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
from conftest import MAX_SEQ
from ship_util import (
    LAUNCH,
    a_program,
    dsv4,
    export,
    import_,
    make_keys,
    one_line_refusal,
    plan_states,
)

from store.fingerprint import fingerprint
from store.signing import key_id, load_public_key, load_signing_key


def test_keys_generate_writes_a_private_key_only_its_owner_reads_and_show_prints_its_line(tmp_path):
    key, pub = make_keys(tmp_path, "builder")
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    line = pub.read_text().strip()
    name, _, kid = line.split()
    assert name == "builder" and kid == key_id(load_public_key(pub).raw) and len(kid) == 16
    assert dsv4("keys", "show", key).stdout.strip() == line
    assert dsv4("keys", "show", pub).stdout.strip() == line
    assert load_signing_key(key).public.line() == line


def test_keys_generate_never_overwrites_a_key(tmp_path):
    key, _ = make_keys(tmp_path, "builder")
    before = key.read_bytes()
    one_line_refusal(dsv4("keys", "generate", "--out", key), "exists already")
    assert key.read_bytes() == before


def test_a_signing_key_others_can_read_is_refused(tmp_path, cold_export_launch, tiny_ckpt_ro):
    key, _ = make_keys(tmp_path, "builder")
    os.chmod(key, 0o644)
    out = tmp_path / "b.tar"
    one_line_refusal(export(tiny_ckpt_ro, cold_export_launch[0], out, key), "refusing the signing key", "chmod 600")
    assert not out.exists()


def test_signing_key_from_the_environment(tmp_path, cold_export_launch, tiny_ckpt_ro):
    key, _ = make_keys(tmp_path, "builder")
    out = tmp_path / "b.tar"
    done = dsv4("cache", "export", "-o", out, "--program", a_program(cold_export_launch[0]), "--kernel-cache-dir",
                cold_export_launch[0],
                env={"DSV4_SIGNING_KEY": str(key)})
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size > 0


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, cold_export_launch, tiny_ckpt_ro):
    """A bundle of the tiny launch's entries, signed by `builder`, and its trusted-keys file."""
    where = tmp_path_factory.mktemp("ship")
    key, trusted = make_keys(where, "builder")
    bundle = where / "tiny.tar"
    done = export(tiny_ckpt_ro, cold_export_launch[0], bundle, key)
    assert done.returncode == 0, done.stderr
    return bundle, key, trusted


def test_export_then_import_into_an_empty_cache_makes_the_launch_hit(shipped, tiny_ckpt_ro, tmp_path):
    bundle, _, trusted = shipped
    dst = tmp_path / "fresh"
    assert set(plan_states(tiny_ckpt_ro, dst).values()) == {"MISS"}
    done = import_(bundle, tiny_ckpt_ro, dst, trusted)
    assert done.returncode == 0, done.stderr
    states = plan_states(tiny_ckpt_ro, dst)
    assert states and set(states.values()) == {"HIT"}
    # importing again installs nothing new and changes nothing
    again = import_(bundle, tiny_ckpt_ro, dst, trusted)
    assert again.returncode == 0 and "0 installed" in again.stdout


def test_an_imported_entry_keeps_its_origin_in_ls_and_why(shipped, tiny_ckpt_ro, tmp_path):
    bundle, key, trusted = shipped
    dst = tmp_path / "fresh"
    assert import_(bundle, tiny_ckpt_ro, dst, trusted).returncode == 0
    entries = json.loads(dsv4("cache", "ls", "--json", "--kernel-cache-dir", dst).stdout)
    kid = load_signing_key(key).public.id
    assert entries and all(e["origin"]["signer"] == kid for e in entries)
    assert all(e["origin"]["reference"] == str(bundle) and e["origin"]["host"] for e in entries)
    manifest = json.loads((dst / "v1" / entries[0]["program"] / entries[0]["fingerprint"] / "manifest.json")
                          .read_text())
    assert manifest["origin"]["signer"] == kid
    why = dsv4("cache", "why", entries[0]["program"], "--model", tiny_ckpt_ro, *LAUNCH, "--kernel-cache-dir", dst)
    assert why.returncode == 0 and f"signed by {kid}" in why.stdout and str(bundle) in why.stdout
    table = dsv4("cache", "ls", "--kernel-cache-dir", dst).stdout
    assert f"from {entries[0]['origin']['host']}, signed by {kid}, {bundle.name} (" in table and " ago)" in table


def test_ls_shortens_a_registry_reference_and_says_when_it_came():
    from store.kernel_cache import Origin

    digest = "0123456789ab" + "f" * 52
    origin = Origin("builder-1", "fedcba9876543210", f"r.example.com:5000/dsv4/programs@sha256:{digest}", 1000.0)
    assert origin.short(now=1000.0 + 7200) == \
        "from builder-1, signed by fedcba9876543210, r.example.com:5000/dsv4/programs@sha256:0123456789ab (2h ago)"


def test_another_layout_is_refused_unless_asked_then_installed_as_other_layout(shipped, tiny_ckpt_ro, tmp_path):
    bundle, _, trusted = shipped
    dst = tmp_path / "fresh"
    other = ("--backend", "export", "--device", "cpu", "--max-seq", str(MAX_SEQ * 2))
    base = ("cache", "import", bundle, "--model", tiny_ckpt_ro, *other, "--kernel-cache-dir", dst,
            "--trusted-keys", trusted)
    one_line_refusal(dsv4(*base), "for another layout", "--other-layout")
    assert not dst.exists()
    done = dsv4(*base, "--other-layout")
    assert done.returncode == 0, done.stderr
    assert "installed (other-layout)" in done.stdout
    entries = json.loads(dsv4("cache", "ls", "--json", "--model", tiny_ckpt_ro, *other, "--kernel-cache-dir",
                              dst).stdout)
    assert entries and {e["state"] for e in entries} == {"other-layout"}
    assert set(plan_states(tiny_ckpt_ro, dst).values()) == {"HIT"}  # the exported layout hits


def test_import_without_trusted_keys_installs_nothing(shipped, tiny_ckpt_ro, tmp_path):
    bundle, _, _ = shipped
    dst = tmp_path / "fresh"
    one_line_refusal(import_(bundle, tiny_ckpt_ro, dst, None), "not trusted", "DSV4_TRUSTED_KEYS")
    assert not dst.exists()


def test_trusted_keys_from_the_environment(shipped, tiny_ckpt_ro, tmp_path):
    bundle, _, trusted = shipped
    dst = tmp_path / "fresh"
    done = dsv4("cache", "import", bundle, "--model", tiny_ckpt_ro, *LAUNCH, "--kernel-cache-dir", dst,
                env={"DSV4_TRUSTED_KEYS": str(trusted)})
    assert done.returncode == 0, done.stderr


def test_export_by_program_and_all_current(shipped, cold_export_launch, tiny_ckpt_ro, tmp_path):
    _, key, _ = shipped
    src = cold_export_launch[0]
    one = tmp_path / "one.tar"
    assert dsv4("cache", "export", "-o", one, "--program", a_program(src), "--kernel-cache-dir", src,
                "--signing-key", key).stdout.startswith(f"{one}: 1 entries")
    every = tmp_path / "all.tar"
    done = dsv4("cache", "export", "-o", every, "--all-current", "--model", tiny_ckpt_ro, *LAUNCH,
                "--kernel-cache-dir", src, "--signing-key", key)
    assert done.returncode == 0, done.stderr
    assert f"{len(plan_states(tiny_ckpt_ro, src))} entries" in done.stdout
    one_line_refusal(dsv4("cache", "export", "-o", every, "--program", a_program(src), "--kernel-cache-dir", src,
                          "--signing-key", key), "exists already")
    one_line_refusal(dsv4("cache", "export", "-o", tmp_path / "x.tar", "--kernel-cache-dir", src,
                          "--signing-key", key), "say which entries")


def test_import_needs_the_launch_to_know_live_keys(shipped, tmp_path):
    bundle, _, trusted = shipped
    one_line_refusal(dsv4("cache", "import", bundle, "--kernel-cache-dir", tmp_path / "c", "--trusted-keys",
                          trusted), "needs --model")


def test_the_consoles_cache_view_says_where_a_brought_entry_came_from():
    from console.data.cache import CacheEntry
    from console.tui.panes.programs import ProgramsPane
    from console.tui.tables import row_of

    raw = {"program": "embed.decode", "state": "current", "size_bytes": 1024, "fingerprint": "ab" * 32,
           "created": 0.0, "hits": 0, "last_used": 0.0, "reason": "",
           "origin": {"host": "builder-1", "signer": "0123456789abcdef", "reference": "/x/b.tar",
                      "time": time.time() - 7200}}
    cells = ProgramsPane()._cache_cells(row_of(CacheEntry.from_json(raw)))  # all of it, as `cache ls` says it
    assert cells["reason"] == "from builder-1, signed by 0123456789abcdef, b.tar (2h ago)"
    assert ProgramsPane()._cache_cells(row_of(CacheEntry.from_json({**raw, "origin": None})))["reason"] == ""


def test_export_reads_exactly_one_selection_verified_and_signed(tmp_path):
    """The one export every transport uses (store.kernel_cache.export_entries): a launch's keys,
    one program, or what is current; a corrupt entry is never shipped."""
    from kernel_cache_samples import ART, entry_dir, make_key, put

    from store import kernel_cache as kc
    from store.signing import SigningKey, TrustedKeys

    cache = kc.KernelCache(tmp_path / "programs")
    live, other = make_key(), make_key(layout={"tp": 2})
    put(cache, live, "layer")
    put(cache, other, "layer")
    put(cache, live, "head")
    art = entry_dir(cache, live, "head") / ART
    art.write_bytes(bytes([art.read_bytes()[0] ^ 0xFF]) + art.read_bytes()[1:])  # same size, another byte
    key = SigningKey.generate("builder")
    policy = kc.TrustPolicy(TrustedKeys({key.public.id: key.public}))

    launch = kc.export_entries(cache, keys={"layer": live, "head": live, "embed": live}, signer=key)
    assert [e.manifest.fingerprint for e in launch.entries] == [fingerprint(live)]
    assert launch.missing == ("head", "embed") and all(policy.signer_problem(e) is None for e in launch.entries)
    assert (entry_dir(cache, live, "head") / ART).exists()  # an export quarantines nothing

    program = kc.export_entries(cache, program="layer")
    assert sorted(e.manifest.fingerprint for e in program.entries) == sorted([fingerprint(live), fingerprint(other)])
    assert all(e.signature is None for e in program.entries)

    current = kc.export_entries(cache, current=kc.Reference(keys={"layer": live, "head": live}))
    assert [e.manifest.fingerprint for e in current.entries] == [fingerprint(live)]
    assert len(current.skipped) == 1 and current.skipped[0].startswith("head/")
