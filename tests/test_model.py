"""The V4 forward pass: packed path vs reference path, decode vs prefill, MTP."""

import pytest
import torch

from runtime.config import load_config
from runtime.engine import Engine
from runtime.model_programs import build_programs
from runtime.pack import PackPlan, pack_in_memory
from runtime.weights import packed_views, reference_views
from store.checkpoint import Checkpoint

TOKENS = torch.tensor([3, 17, 250, 9, 41, 42, 43, 100, 7, 7, 7, 300, 12, 13, 14, 15, 16, 90, 91, 92,
                       93, 94, 95, 96, 97, 98, 99, 101, 102, 103, 104, 105, 106, 107, 108])


@pytest.fixture(scope="module")
def model(tiny_ckpt_ro):
    ck = Checkpoint.open(tiny_ckpt_ro)
    config = load_config(tiny_ckpt_ro)
    plan = PackPlan(config, ranks=1)
    programs = build_programs(config, plan, max_seq=64)
    return ck, plan, programs, packed_views(plan, pack_in_memory(ck, plan))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_packed_path_is_the_checkpoints_model(model):
    """The packed layout keeps the checkpoint's FP8 bytes, FP4 codes and E8M0 block scales, so
    packed logits equal the float reference (dequantised straight from the checkpoint) to float
    rounding, and every greedy argmax agrees: packing changes the layout, never the model."""
    ck, plan, programs, packed = model
    got = Engine(programs, packed).forward(TOKENS).logits
    want = Engine(programs, reference_views(ck, plan)).forward(TOKENS).logits
    assert _rel(got, want) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_decode_after_prefill_equals_one_longer_prefill(model):
    """Tolerance 1e-4 absolute on logits of magnitude ~1: float32 summation-order noise only."""
    _, _, programs, packed = model
    full = Engine(programs, packed).forward(TOKENS).logits
    engine = Engine(programs, packed)
    parts = [engine.forward(TOKENS[:20]).logits]
    parts += [engine.forward(t[None]).logits for t in TOKENS[20:]]
    assert (torch.cat(parts) - full).abs().max().item() < 1e-4
    assert engine.length == len(TOKENS)


def test_every_packed_tensor_is_consumed(model):
    _, _plan, programs, packed = model
    seen: set[str] = set()

    class Recording(dict):
        def __getitem__(self, key):
            seen.add((self.group, key))
            return super().__getitem__(key)

        def get(self, key, default=None):
            if key in self:
                seen.add((self.group, key))
            return super().get(key, default)

    groups = {}
    for g, w in packed.groups.items():
        r = Recording(w)
        r.group = g
        groups[g] = r
    engine = Engine(programs, type(packed)(groups))
    step = engine.forward(TOKENS[:8])
    engine.mtp(step.hidden[:-1], TOKENS[1:8], 0)
    every = {(g, k) for g, w in packed.groups.items() for k in w}
    assert every - seen == set()


def test_mtp_draft_logits(model):
    _, _, programs, packed = model
    engine = Engine(programs, packed)
    step = engine.forward(TOKENS[:10])
    draft = engine.mtp(step.hidden[:-1], TOKENS[1:10], 0)
    assert draft.shape == (9, programs.dims.vocab) and draft.isfinite().all()


def test_greedy_generation_is_deterministic_and_bounded(model):
    _, _, programs, packed = model
    a = list(Engine(programs, packed).generate([5, 6, 7], 6))
    b = list(Engine(programs, packed).generate([5, 6, 7], 6))
    assert a == b and len(a) == 6
    engine = Engine(programs, packed)
    with pytest.raises(ValueError, match="exceeds max_seq"):
        engine.forward(torch.zeros(65, dtype=torch.int64))
