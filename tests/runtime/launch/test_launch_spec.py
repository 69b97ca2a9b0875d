"""One launch spec: every flag round-trips through argv, defaults are written once, bad values are
one line, and what the console runs carries every setting it was started with."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from runtime.launch import spec as S
from runtime.launch.spec import DEFAULTS, FLAGS, LaunchSpec, add_flags, from_args, parse
from store.errors import UserError

# a value other than the default for every field: a new field without one here fails the test
SAMPLES = {
    "model": Path("/models/v4"), "kernel_cache_dir": Path("/cache/k"), "backend": "export", "device": "cpu",
    "ranks": 2, "max_seq": 512, "max_slots": 7, "max_batch": 3, "memory_utilization": 0.5,
    "device_memory": 8 << 30, "use_sidecar": False, "cold_policy": "read", "ready": "auto", "jobs": 3,
    "speculative": "off", "compile_after_ready": "error", "validate_tokens": 2, "max_body": 1 << 20,
    "queue_timeout": 2.5, "host": "0.0.0.0",
    "port": 0, "master_port": 29400, "rendezvous_timeout": 5.0, "rank_timeout": 2.5, "stall_timeout": 30.0,
    "signing_key": Path("/keys/signing.key"), "trusted_keys": Path("/keys/trusted"), "events": "-",
    "api_key_file": Path("/keys/api"), "status_needs_key": False, "ssl_certfile": Path("/tls/cert.pem"),
    "ssl_keyfile": Path("/tls/key.pem"), "ssl_ca_certs": Path("/tls/clients.pem"), "ca_file": Path("/tls/ca.pem"),
    "read_timeout": 30.0, "root_path": "/dsv4", "log_format": "json", "log_file": Path("/tmp/dsv4-serve.log"),
}
COMMANDS = (S.SERVE, S.COMPILE, S.PLAN, S.CONSOLE, S.PREPACK, S.CACHE, S.SIDECAR_PURGE)


def test_every_field_has_one_flag_and_a_sample():
    assert set(SAMPLES) == {f.name for f in fields(LaunchSpec)} == {f.field for f in FLAGS}
    for name, value in SAMPLES.items():
        assert value != getattr(DEFAULTS, name), name


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_every_command_round_trips_through_argv(command, tmp_path):
    own = {f.field for f in FLAGS if command in f.commands}
    spec = LaunchSpec(**{k: v for k, v in {**SAMPLES, "model": tmp_path}.items() if k in own})
    if command not in (S.SERVE, S.CONSOLE, S.PLAN):
        spec = spec.with_(ready=DEFAULTS.ready)
    assert parse(spec.argv(command), command) == spec


def test_a_model_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="config.json: not a directory; point at a checkpoint directory"):
        parse([str(tmp_path / "config.json")], S.PLAN)


def test_argv_leaves_defaults_out_and_says_each_setting_once():
    assert LaunchSpec().argv(S.SERVE) == []
    argv = LaunchSpec(Path("/m"), ranks=2, use_sidecar=False, port=0).argv(S.SERVE)
    assert argv == ["/m", "--ranks", "2", "--no-sidecar", "--port", "0"]
    assert LaunchSpec(Path("/m"), ready="auto").argv(S.CONSOLE) == ["--model", "/m"]  # auto is the console's default


def test_parsers_take_their_defaults_from_the_spec(tmp_path):
    for command in COMMANDS:
        parser = argparse.ArgumentParser()
        add_flags(parser, command)
        args = parser.parse_args([] if command != S.PREPACK else [str(tmp_path)])
        spec = from_args(args, command)
        for f in FLAGS:
            if command in f.commands and f.field != "model":
                assert getattr(spec, f.field) == S.default_of(f, command), (command, f.field)


@pytest.mark.parametrize("argv, says", [
    (["--port", "70000"], "--port 70000 is out of range; allowed 0..65535 (0: any free port)"),
    (["--memory-utilization", "nan"], "--memory-utilization nan is out of range; allowed above 0 up to 1"),
    (["--max-slots", "0"], "--max-slots 0 is out of range; allowed 1..4096"),
    (["--max-seq", "8"], "--max-seq 8 is out of range"),
    (["--ready", "early", "--ranks", "2"], "--ready early serves one rank only"),
    (["--events", "/no/such/dir/events.jsonl"],
     "--events /no/such/dir/events.jsonl: directory /no/such/dir does not exist"),
    (["/no/such/model"], "/no/such/model: no such directory; point at a checkpoint directory"),
    (["--log-file", "/no/such/dir/serve.log"],
     "--log-file /no/such/dir/serve.log: directory /no/such/dir does not exist"),
])
def test_a_bad_setting_is_one_line(argv, says):
    with pytest.raises(UserError) as e:
        parse(argv, S.SERVE)
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


def test_under_torchrun_ranks_is_the_world_size_and_must_agree():
    parser = argparse.ArgumentParser()
    add_flags(parser, S.SERVE)
    assert from_args(parser.parse_args([]), S.SERVE, world=4).ranks == 4
    assert from_args(parser.parse_args(["--ranks", "4"]), S.SERVE, world=4).ranks == 4
    with pytest.raises(UserError, match="--ranks 2 but WORLD_SIZE=4"):
        from_args(parser.parse_args(["--ranks", "2"]), S.SERVE, world=4)


def test_what_a_two_rank_console_runs_carries_its_ranks(tmp_path):
    """`w` compiles, `l` launches and `p` packs for the ranks the console was started with, and
    `l` never asks for what `dsv4 serve` refuses (--ready early with ranks)."""
    console = S.parse(["--model", str(tmp_path), "--ranks", "2", "--max-seq", "512", "--kernel-cache-dir", "/k"],
                      S.CONSOLE)
    assert console.ready == "auto"
    for command in (S.COMPILE, S.SERVE):
        assert parse(console.argv(command), command).ranks == 2
        assert parse(console.argv(command), command).max_seq == 512
        assert parse(console.argv(command), command).kernel_cache_dir == Path("/k")
    assert parse(console.argv(S.PREPACK), S.PREPACK).ranks == 2
    assert parse(console.argv(S.SERVE), S.SERVE).ready == "auto"  # resolved by the launch's own plan
