"""Prepack: the sidecar the packer writes, how loading judges it, and `dsv4 prepack`.

Peak memory of prepack is left to `dsv4 bench sidecar`: on the tiny preset the packed layers
are a few MiB against a ~300 MiB torch process, so an RSS bound here would pin nothing.
"""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

from console.cli import main as cli
from runtime.weights import layout as layout_module
from runtime.weights import pack
from runtime.weights.prepack import judge, open_prepacked, packed_layout, prepack, sidecar_key
from store import atomic, pagecache, sidecar
from store.checkpoint import Checkpoint
from store.sidecar import MAP, REPACK


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


@pytest.fixture(scope="module")
def packed(tiny_ckpt_ro, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A sidecar of the shared tiny checkpoint (written elsewhere: the checkpoint stays
    untouched) and the no-sidecar path's tensors for the same checkpoint."""
    out = tmp_path_factory.mktemp("prepacked") / "tiny.r1.safetensors"
    prepack(tiny_ckpt_ro, out=out)
    with Checkpoint.open(tiny_ckpt_ro) as ckpt:
        reference = pack.pack_in_memory(ckpt, packed_layout(tiny_ckpt_ro, 1))
    return out, reference


def staging_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if atomic.is_staging(p.name)]


def test_mapped_sidecar_equals_packing_from_the_checkpoint_byte_for_byte(packed, tiny_ckpt_ro):
    path, reference = packed
    pagecache.warm(path, remember=False)
    assert judge(tiny_ckpt_ro, 1, path).action == MAP
    verdict, mapped = open_prepacked(tiny_ckpt_ro, 1, path)
    assert verdict.action == MAP, verdict.line()
    with mapped:
        assert set(mapped.tensors) == set(reference)
        bad = [n for n, t in reference.items() if not same_bytes(mapped.tensors[n], t)]
        assert bad == []


def test_sidecar_loads_with_safetensors_and_equals_the_packed_tensors(packed):
    path, reference = packed
    loaded = load_file(path)
    assert set(loaded) == set(reference)
    assert [n for n, t in reference.items() if not same_bytes(loaded[n], t)] == []


def test_sidecar_records_the_key_taken_before_packing_and_the_packing_time(packed, tiny_ckpt_ro):
    path, _ = packed
    verdict = sidecar.inspect(path, expected_key=sidecar_key(tiny_ckpt_ro, 1))
    assert verdict.action == MAP or verdict.reason == "cold"
    assert verdict.pack_seconds is not None and verdict.pack_seconds > 0


def test_shard_touched_while_packing_leaves_a_sidecar_stale_naming_that_shard(tiny_ckpt):
    shard = Checkpoint.open(tiny_ckpt).shard_paths()[-1]

    def touch_once(p) -> None:
        if p.layer == 1:
            st = shard.stat()
            os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    info = prepack(tiny_ckpt, progress=touch_once)
    assert info.path.is_file() and shard.name in info.stale_detail
    verdict = judge(tiny_ckpt, 1)
    assert (verdict.action, verdict.reason) == (REPACK, "stale")
    assert any(shard.name in c and "mtime_ns" in c for c in verdict.changes), verdict.changes


def test_sidecar_takes_the_mode_of_the_source_shard(tiny_ckpt):
    for shard in Checkpoint.open(tiny_ckpt).shard_paths():
        shard.chmod(0o640)
    info = prepack(tiny_ckpt)
    assert stat.S_IMODE(info.path.stat().st_mode) == 0o640


def test_other_ranks_are_stale_naming_ranks(packed, tiny_ckpt_ro):
    path, _ = packed
    verdict = judge(tiny_ckpt_ro, 2, path)
    assert (verdict.action, verdict.reason) == (REPACK, "stale")
    assert verdict.changes == ("ranks is 1 here; this launch uses 2",)


def test_a_new_packer_version_is_stale_naming_it(packed, tiny_ckpt_ro, monkeypatch):
    path, _ = packed
    old, new = layout_module.PACKER_VERSION, str(int(layout_module.PACKER_VERSION) + 1)
    monkeypatch.setattr(layout_module, "PACKER_VERSION", new)
    verdict = judge(tiny_ckpt_ro, 1, path)
    assert (verdict.action, verdict.reason) == (REPACK, "stale")
    assert verdict.changes == (f"packer_version is {old} here; this launch uses {new}",)


def test_a_missing_tensor_is_repack_names(tiny_ckpt, tmp_path):
    layout = packed_layout(tiny_ckpt, 1)
    dropped = "layers.attn.wq_a.qscale"
    assert dropped in layout.tensors
    shapes = [sidecar.TensorShape(t.name, t.dtype, t.shape)
                   for t in layout.tensors.values() if t.name != dropped]  # fmt: skip
    key = sidecar_key(tiny_ckpt, 1)
    with Checkpoint.open(tiny_ckpt) as ckpt:
        parts = (p for p in pack.stream(ckpt, layout) if p[0] != dropped)
        path = sidecar.write_sidecar(tmp_path / "short.safetensors", shapes, parts,
                                     metadata=sidecar.sidecar_metadata(key, tiny_ckpt)).path  # fmt: skip
    verdict = judge(tiny_ckpt, 1, path)
    assert (verdict.action, verdict.reason) == (REPACK, "names")
    assert dropped in verdict.detail and "1 missing" in verdict.detail


# --- crash safety -----------------------------------------------------------------------------

# A real `dsv4 prepack` whose packer prints a marker after layer K and from then on yields
# slowly (a slow disk), so a kill lands mid-write whatever the machine's speed.
KILLABLE = textwrap.dedent(
    """
    import sys, time
    from runtime.weights import pack
    from console.cli import main

    K, real_stream = int(sys.argv[1]), pack.stream

    def stream(ckpt, layout, progress=None):
        marked = False
        def on_layer(done, total, group):
            nonlocal marked
            if done == K:
                print("MARK", flush=True)
                marked = True
        for item in real_stream(ckpt, layout, on_layer):
            if marked:
                time.sleep(0.02)
            yield item

    pack.stream = stream
    sys.exit(main(["prepack", sys.argv[2]]))
    """
)


@pytest.mark.slow
def test_sigkill_mid_write_leaves_no_sidecar_and_the_next_prepack_sweeps_and_succeeds(tiny_ckpt):
    final = sidecar.default_sidecar_path(tiny_ckpt, 1)
    layers = len(packed_layout(tiny_ckpt, 1).groups)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rng = random.Random(4)
    for _trial in range(3):
        marker_layer, delay = rng.randint(1, layers - 1), rng.uniform(0.0, 0.3)
        proc = subprocess.Popen(
            [sys.executable, "-c", KILLABLE, str(marker_layer), str(tiny_ckpt)],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            line = proc.stdout.readline()
            assert line.strip() == "MARK", (line, proc.stderr.read())
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
        assert not final.exists()
        assert staging_files(tiny_ckpt), "the killed writer left its staging file"
    leftovers = staging_files(tiny_ckpt)
    info = prepack(tiny_ckpt)
    assert sorted(info.swept) == sorted(leftovers)
    assert staging_files(tiny_ckpt) == []
    pagecache.warm(final, remember=False)
    assert judge(tiny_ckpt, 1).action == MAP


# --- CLI --------------------------------------------------------------------------------------


def test_prepack_refuses_to_overwrite_without_force_and_replaces_with_force(tiny_ckpt, capsys):
    assert cli(["prepack", str(tiny_ckpt)]) == 0
    out = capsys.readouterr().out.strip()
    final = sidecar.default_sidecar_path(tiny_ckpt, 1)
    assert out.startswith(f"wrote {final}:") and " s (packing " in out and "\n" not in out
    first = final.stat().st_ino

    assert cli(["prepack", str(tiny_ckpt)]) == 1
    err = capsys.readouterr().err.strip()
    assert "already exists" in err and "--force" in err and "\n" not in err
    assert final.stat().st_ino == first

    assert cli(["prepack", str(tiny_ckpt), "--force"]) == 0
    capsys.readouterr()
    assert final.stat().st_ino != first and judge(tiny_ckpt, 1).reason in ("", "cold")


@pytest.mark.parametrize(
    "args, message",
    [
        (["{missing}"], "no such directory; point at a checkpoint directory"),
        (["{ckpt}", "--ranks", "3"], "not divisible by ranks=3"),
        (["{ckpt}", "--out", "{missing}/x.safetensors"], "no such directory"),
    ],
)
def test_prepack_user_errors_are_one_line(tiny_ckpt, tmp_path, capsys, args, message):
    argv = [a.format(ckpt=tiny_ckpt, missing=tmp_path / "missing") for a in args]
    assert cli(["prepack", *argv]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and err.startswith("dsv4 prepack: ")


def test_status_of_a_checkpoint_judges_as_loading_would(tiny_ckpt, capsys, monkeypatch):
    prepack(tiny_ckpt)
    assert cli(["sidecar", "status", str(tiny_ckpt), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verdict"] == MAP or data["reason"] == "cold"
    assert data["judged_against"].startswith("this packer's")

    old = layout_module.PACKER_VERSION
    monkeypatch.setattr(layout_module, "PACKER_VERSION", "999")
    assert cli(["sidecar", "status", str(tiny_ckpt), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["verdict"], data["reason"]) == (REPACK, "stale")
    assert data["changes"] == [f"packer_version is {old} here; this launch uses 999"]

    # A sidecar FILE in a checkpoint dir is judged as a launch from that dir would judge it.
    path = sidecar.default_sidecar_path(tiny_ckpt, 1)
    assert cli(["sidecar", "status", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["verdict"], data["reason"]) == (REPACK, "stale")
    assert data["judged_against"].startswith("this packer's")


def test_a_renamed_checkpoint_keeps_its_sidecar_and_nothing_purges_it(tiny_ckpt, capsys):
    prepack(tiny_ckpt)
    moved = tiny_ckpt.parent / "moved"
    tiny_ckpt.rename(moved)
    path = sidecar.default_sidecar_path(moved, 1)
    for target in (moved, path):
        assert cli(["sidecar", "status", str(target), "--json", "--cold-policy", "read"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["verdict"] == MAP, data["detail"]
    assert cli(["sidecar", "purge", str(moved), "--yes"]) == 0
    assert "0 the plan calls stale or corrupt" in capsys.readouterr().out and path.is_file()
    # a sidecar whose checkpoint cannot be read is not stale: it is never purged either
    (moved / "config.json").unlink()
    elsewhere = moved.parent / "elsewhere"
    elsewhere.mkdir()
    os.replace(path, elsewhere / path.name)
    assert cli(["sidecar", "status", str(elsewhere / path.name), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reason"] == "source"


def test_sidecar_purge_deletes_a_stale_sidecar_and_says_why(tiny_ckpt, capsys):
    prepack(tiny_ckpt)
    path = sidecar.default_sidecar_path(tiny_ckpt, 1)
    config = json.loads((tiny_ckpt / "config.json").read_text())
    (tiny_ckpt / "config.json").write_text(json.dumps({**config, "edited": True}))
    assert cli(["sidecar", "purge", str(tiny_ckpt), "--dry-run"]) == 0
    assert "stale: changed: config_sha256" in capsys.readouterr().out and path.is_file()
    assert cli(["sidecar", "purge", str(tiny_ckpt), "--yes"]) == 0
    assert not path.exists()
