"""The V4 forward pass: packed path vs reference path, decode vs prefill, MTP."""

import pytest
import torch

from runtime.engine.engine import Engine
from runtime.model.config import load_config
from runtime.programs.catalog import build_programs
from runtime.weights.pack import PackedLayout, pack_in_memory
from runtime.weights.views import packed_views, reference_views
from store.checkpoint import Checkpoint

TOKENS = torch.tensor([3, 17, 250, 9, 41, 42, 43, 100, 7, 7, 7, 300, 12, 13, 14, 15, 16, 90, 91, 92,
                       93, 94, 95, 96, 97, 98, 99, 101, 102, 103, 104, 105, 106, 107, 108])


@pytest.fixture(scope="module")
def model(tiny_ckpt_ro):
    ck = Checkpoint.open(tiny_ckpt_ro)
    config = load_config(tiny_ckpt_ro)
    layout = PackedLayout(config, ranks=1)
    programs = build_programs(config, layout, max_seq=64)
    return ck, layout, programs, packed_views(layout, pack_in_memory(ck, layout))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_packed_path_is_the_checkpoints_model(model):
    """The packed layout keeps the checkpoint's FP8 bytes, FP4 codes and E8M0 block scales, so
    packed logits equal the float reference (dequantised straight from the checkpoint) to float
    rounding, and every greedy argmax agrees: packing changes the layout, never the model."""
    ck, layout, programs, packed = model
    got = Engine(programs, packed).forward(TOKENS).logits
    want = Engine(programs, reference_views(ck, layout)).forward(TOKENS).logits
    assert _rel(got, want) < 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.slow
def test_decode_after_prefill_equals_one_longer_prefill(model):
    """Tolerance 1e-4 absolute on logits of magnitude ~1: float32 summation-order noise only."""
    _, _, programs, packed = model
    full = Engine(programs, packed).forward(TOKENS).logits
    engine = Engine(programs, packed)
    parts = [engine.forward(TOKENS[:20]).logits]
    parts += [engine.forward(t[None]).logits for t in TOKENS[20:]]
    assert (torch.cat(parts) - full).abs().max().item() < 1e-4
    assert engine.lengths[0] == len(TOKENS)


def test_chunked_weights_compute_the_same_model(model, monkeypatch):
    """A large weight is dequantised and multiplied a chunk of output columns at a time: tiny's
    are small, so force chunks of 2 K floats (every projection and the head split, FP8 ones
    along their scale blocks) and compare a prefill and a decode step with whole weights."""
    from runtime.model import ops as m

    _, _, programs, packed = model
    want_engine = Engine(programs, packed)
    want = [want_engine.forward(TOKENS[:20]).logits, want_engine.forward(TOKENS[20:21]).logits]
    monkeypatch.setattr(m, "CHUNK_ELEMENTS", 2048)
    assert m.chunk_units(512, 256, 32) == 32 and m.chunk_units(10_000, 1) == 2048 and m.chunk_units(8, 1 << 20) == 1
    assert m.chunk_units(1 << 20, 64) == (1 << 20) // m.MAX_CHUNKS  # never more than MAX_CHUNKS chunks
    engine = Engine(programs, packed)
    got = [engine.forward(TOKENS[:20]).logits, engine.forward(TOKENS[20:21]).logits]
    for g, w in zip(got, want, strict=True):
        # chunks sum in another order than one matmul, and how intra-op threads split each depends
        # on the thread count: on two threads the same model differs by ~1.03e-6 relative here
        assert _rel(g, w) < 1e-5
        assert torch.equal(g.argmax(-1), w.argmax(-1))


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


@pytest.mark.slow
def test_greedy_generation_is_deterministic_and_bounded(model):
    _, _, programs, packed = model
    a = list(Engine(programs, packed).generate([5, 6, 7], 6))
    b = list(Engine(programs, packed).generate([5, 6, 7], 6))
    assert a == b and len(a) == 6
    engine = Engine(programs, packed)
    with pytest.raises(ValueError, match="exceeds max_seq"):
        engine.forward(torch.zeros(65, dtype=torch.int64))


def _alone(programs, packed, prompt, n):
    return list(Engine(programs, packed).generate(prompt, n))


@pytest.mark.slow
def test_batched_decode_equals_each_sequence_alone(model):
    """Sequences of different lengths arrive at different steps, prefill alone, then decode
    together in one call per program (slot order shuffled, one leaves early): every greedy token
    equals the sequence run alone."""
    _, _, programs, packed = model
    prompts = {0: TOKENS[:5].tolist(), 1: TOKENS[:23].tolist(), 2: TOKENS[3:12].tolist(), 3: TOKENS[:33].tolist()}
    wanted = {0: 12, 1: 6, 2: 14, 3: 9}
    arrive = {0: 0, 1: 2, 2: 3, 3: 5}
    engine = Engine(programs, packed, slots=4)
    slot_of = {0: 3, 1: 0, 2: 2, 3: 1}
    got: dict[int, list[int]] = {}
    pending: dict[int, int] = {}  # sequence → its last token, not yet appended
    for step in range(40):
        for seq, at in arrive.items():
            if at == step:
                logits = engine.step([(slot_of[seq], prompts[seq])]).logits
                pending[seq] = int(logits[-1].argmax())
                got[seq] = [pending[seq]]
        live = [s for s in pending if len(got[s]) < wanted[s]]
        for s in [s for s in pending if s not in live]:
            del pending[s]
        if not live:
            if step > max(arrive.values()):
                break
            continue
        logits = engine.step([(slot_of[s], [pending[s]]) for s in live]).logits
        for row, s in enumerate(live):
            pending[s] = int(logits[row].argmax())
            got[s].append(pending[s])
    assert got == {s: _alone(programs, packed, prompts[s], wanted[s]) for s in prompts}


@pytest.mark.slow
def test_decode_reads_only_its_window_and_the_finished_entries(model):
    """Incremental compressed KV: after the prompt, a decode step reads the sliding window's KV
    rows, the compressor inputs of its own (and, CSA, the previous) window, and the finished
    entries: poisoning every other per-token row with NaN changes no logit."""
    _, _, programs, packed = model
    prompt = TOKENS[:33]
    clean, poisoned = Engine(programs, packed), Engine(programs, packed)
    clean.forward(prompt)
    poisoned.forward(prompt)
    pos = len(prompt)  # the next token's position
    d = programs.dims
    for group, v in programs.variants.items():
        for name, cache in poisoned.caches[group].items():
            if name == "kv":
                cache[0, : pos - d.window + 1] = float("nan")
            elif name not in ("entries", "ikeys") and v.ratio:
                cache[0, : (pos // v.ratio - 1) * v.ratio] = float("nan")
    for token in (5, 6, 7, 8, 9, 10, 11, 12):
        a, b = clean.forward(torch.tensor([token])).logits, poisoned.forward(torch.tensor([token])).logits
        assert torch.equal(a, b)


def _ran(fn) -> set[str]:
    """The names of the ops `fn` ran, as torch's profiler saw them."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def test_matmuls_of_several_rows_of_a_large_weight_run_through_onednn_eagerly_and_in_programs(monkeypatch):
    """`ops.matmul` where oneDNN is chosen (an AMD cpu: MKL's small-row GEMMs are 2-3× slower
    there): oneDNN's linear for two rows or more of a large weight, torch's matmul for one row (a
    GEMV) and for a small weight; the same float32 products either way. Traced, it is
    `dsv4::matmul`, which inductor leaves alone (it lowers oneDNN's linear only onto constant
    weights) and which makes the same choice when the program runs, by the rows it gets."""
    from runtime.model import ops as m

    onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if not torch.backends.mkldnn.is_available() or onednn is None:
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(m, "_ONEDNN_LINEAR", onednn)  # whatever this host's cpu
    gen = torch.Generator().manual_seed(0)
    large = torch.randn(1024, 512, generator=gen)
    small = torch.randn(256, 128, generator=gen)

    class Product(torch.nn.Module):
        def forward(self, x, w):
            return m.matmul(x, w * 1.0)  # a weight computed in the graph, as a dequantised one is

    rows = torch.export.Dim("rows", min=1, max=64)
    programs = {}
    for w in (large, small):
        programs[w.shape] = torch.export.export(Product(), (torch.randn(32, w.shape[0]), w),
                                                dynamic_shapes=({0: rows}, None))
    assert "dsv4.matmul" in programs[large.shape].graph_module.code
    assert "dsv4" not in programs[small.shape].graph_module.code and \
        "aten.matmul" in programs[small.shape].graph_module.code
    for rows, w, via in ((1, large, "aten::mm"), (2, large, "mkldnn::_linear_pointwise"),
                         (32, large, "mkldnn::_linear_pointwise"), (32, small, "aten::mm")):
        x = torch.randn(rows, w.shape[0], generator=gen)
        for run in (m.matmul, programs[w.shape].module()):
            ran = _ran(lambda x=x, w=w, run=run: run(x, w))
            assert via in ran and ({"aten::mm", "mkldnn::_linear_pointwise"} - {via}).isdisjoint(ran), (rows, ran)
            assert _rel(run(x, w), x @ w) < 1e-6


def test_without_onednn_every_matmul_is_torchs_and_traces_as_torchs(monkeypatch):
    """Where MKL is the faster (an Intel cpu: `ops._onednn_linear` gives None), a large weight's
    product is torch's matmul eagerly and in the trace, which inductor then compiles itself."""
    from runtime.model import ops as m

    monkeypatch.setattr(m, "_ONEDNN_LINEAR", None)
    w = torch.randn(1024, 512)

    class Product(torch.nn.Module):
        def forward(self, x, w):
            return m.matmul(x, w * 1.0)

    program = torch.export.export(Product(), (torch.randn(32, 1024), w),
                                  dynamic_shapes=({0: torch.export.Dim("rows", min=1, max=64)}, None))
    assert "dsv4" not in program.graph_module.code and "aten.matmul" in program.graph_module.code
    x = torch.randn(8, 1024)
    ran = _ran(lambda: m.matmul(x, w))
    assert "aten::mm" in ran and "mkldnn::_linear_pointwise" not in ran
