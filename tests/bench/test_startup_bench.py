"""`dsv4 bench startup`'s peer set-up stands in for the programs phase (torch.compile instead of the
kernel cache): its records must carry every key a real phase's do, which registration reads (a
missing `tier` failed the set-up with a KeyError)."""

from types import SimpleNamespace

import torch

from bench.startup_bench import _torch_compile_programs
from runtime.events import Emitter
from runtime.model.config import load_config
from runtime.programs.catalog import build_programs
from runtime.programs.phase import prepare_programs
from runtime.weights.layout import PackedLayout


def test_the_peer_set_up_records_each_program_as_a_programs_phase_does(tiny_ckpt_ro, monkeypatch):
    config = load_config(tiny_ckpt_ro)
    plan = SimpleNamespace(backend="eager", device="cpu", programs=[],
                           catalog=build_programs(config, PackedLayout(config), 64))
    events = []
    real = prepare_programs(plan, Emitter(events.append)).results
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)  # the programs run eagerly: the records are the point
    peer = _torch_compile_programs(plan, Emitter(events.append)).results
    assert [r["program"] for r in peer] == [r["program"] for r in real] == list(plan.catalog.specs)
    assert all(set(r) == set(real[0]) for r in peer + real)
    assert {r["tier"] for r in peer} == {"compiled"} and {r["outcome"] for r in peer} == {"TORCH.COMPILE"}
