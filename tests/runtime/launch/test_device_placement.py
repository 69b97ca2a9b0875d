"""The cuda/npu path without an accelerator: every program runs, and traces, on the `meta`
device. A tensor the model makes on the cpu (a constant built without `device=`) meets the
inputs' device there exactly as it would meet cuda's, and fails the same way; on a cpu-only
run it never shows. (Issue 28: rope's inverse frequencies were built on the cpu, so no layer
program could have run, or compiled, on a GPU.)"""

from __future__ import annotations

import pytest
import torch

from runtime.programs import build
from runtime.programs.catalog import build_programs
from runtime.programs.spec import build_function
from runtime.synth.checkpoint import preset_config
from runtime.weights.layout import PackedLayout

pytestmark = pytest.mark.slow

# above the MoE's dense threshold (256 rows), so prefill programs take both expert paths
MAX_SEQ = 320


def _programs(ranks: int):
    config = preset_config("tiny")
    return build_programs(config, PackedLayout(config, ranks), MAX_SEQ)


def _inputs(spec, size) -> tuple[torch.Tensor, ...]:
    sizes = {d.name: size(d) for d in spec.dims}
    return tuple(torch.empty([sizes[s] if isinstance(s, str) else s for s in t.shape],
                             dtype=getattr(torch, t.dtype), device="meta") for t in spec.inputs)


@pytest.mark.parametrize("ranks", [1, 2])
def test_every_program_runs_on_a_device_other_than_the_cpu(ranks):
    programs = _programs(ranks)
    assert any(n.startswith("layer.") for n in programs.specs)
    for name, spec in programs.specs.items():
        for size in (lambda d: d.min, lambda d: d.max):
            out = build_function(spec)(*_inputs(spec, size))
            leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            assert leaves and all(t.device.type == "meta" for t in leaves), name


@pytest.mark.slow
def test_each_kind_of_program_compiles_for_a_device_other_than_the_cpu():
    """torch.export on meta inputs: the formulations written for a compiler (only traced, never
    run eagerly) place every tensor they make on the inputs' device too."""
    programs = _programs(2)
    names = [n for n in programs.specs if n.endswith(".decode") or n.startswith("experts.")]
    kinds = {n.split(".")[1] for n in names if n.startswith("layer.")}
    assert len(kinds) >= 3  # sliding, CSA and HCA layers
    for name in names:
        exported = build.export_program(programs.specs[name], "meta")
        devices = {n.meta["val"].device.type for n in exported.graph.nodes
                   if isinstance(n.meta.get("val"), torch.Tensor)}
        assert devices == {"meta"}, (name, devices)


def test_the_engine_runs_every_kind_of_step_on_a_device_other_than_the_cpu(tiny_ckpt_ro):
    """The engine's own glue (row indices, slots, cache writes, MTP rows) on the meta device: a
    tensor it made on the cpu fails as on cuda, and so does reading the device back (`.item()`,
    a boolean mask's nonzero), which on a GPU would stall every layer of every step."""
    from runtime.engine.engine import Engine
    from runtime.model.config import load_config
    from runtime.weights.pack import pack_in_memory
    from runtime.weights.views import packed_views
    from store.checkpoint import Checkpoint

    config = load_config(tiny_ckpt_ro)
    layout = PackedLayout(config, 1)
    host = pack_in_memory(Checkpoint.open(tiny_ckpt_ro), layout)
    weights = packed_views(layout, {name: t.to("meta") for name, t in host.items()})
    engine = Engine(build_programs(config, layout, 128), weights, device="meta", slots=3)
    step = engine.forward(torch.arange(1, 18), 0)  # a prefill past the compressed layers' windows
    assert step.logits.device.type == "meta" and step.logits.shape == (17, config.vocab_size)
    for _ in range(4):  # decode steps across a window's end, beside a packed prompt's rows
        step = engine.step([(0, torch.tensor([5])), (1, torch.tensor([6, 7, 8]))])
        assert step.logits.device.type == "meta" and step.logits.shape[0] == 4
    drafts = engine.mtp_step([(0, 17, step.hidden[:1], [9]), (1, 0, step.hidden[1:], [7, 8, 9])])
    assert drafts.device.type == "meta" and drafts.shape[0] == 4
    engine.copy_slot(0, 2)
    engine.truncate(0, 18)
    assert engine.lengths == [18, 12, 21]
