"""The llama.cpp side of `dsv4 bench peer` without building it: a server that cannot start is one
line naming its log's first error, and a converted checkpoint is found again only while its files
are the same."""

from __future__ import annotations

import os
import shutil

import pytest

from bench import llamacpp_peer as lc


def test_a_server_that_exits_is_one_line_with_its_first_error(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho '0.00.000.100 I srv load_model: loading'\n"
                    "echo '0.00.076.704 E llama_model_load: error loading model: DeepSeek-V4 loader only supports "
                    "compression ratios 0, 4, and 128'\necho '0.00.098.482 E srv llama_server: exiting'\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(lc.PeerUnavailable,
                       match=r"^llama-server exited 3: DeepSeek-V4 loader only supports compression ratios "
                             r"0, 4, and 128$"):
        lc.Server(fake, tmp_path / "m.gguf", threads=1, slots=1, ctx=64, log_file=tmp_path / "server.log")


def test_a_conversion_is_keyed_by_the_checkpoints_files(tiny_ckpt_ro, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt_ro, ckpt)
    before = lc._checkpoint_id(ckpt)
    assert lc._checkpoint_id(ckpt) == before
    shard = next(ckpt.glob("*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 1))
    assert lc._checkpoint_id(ckpt) != before  # a rewritten shard converts again


def test_the_cache_lives_under_the_user_cache_dir_never_the_project():
    root = lc.cache_root()
    assert root.name == "llama.cpp" and root.parent.name == "dsv4-console"
    assert not str(root).startswith(str(lc.Path(lc.__file__).resolve().parents[1]))
