"""Sampling parameters (issue 27): top-k, top-p, min-p and the penalties with OpenAI's and
vLLM's semantics, on one sequence's seeded sampler; in the batched engine each request keeps
its own tokens whatever its neighbours ask, and speculation stays exact."""

from __future__ import annotations

import asyncio

import pytest
import torch

from runtime.engine.engine import Engine
from runtime.engine.sampling import Sampler, Sampling
from runtime.model.config import load_config
from runtime.programs.catalog import build_programs
from runtime.serve.scheduler import Scheduler
from runtime.weights.pack import PackedLayout, pack_in_memory
from runtime.weights.views import packed_views
from store.checkpoint import Checkpoint

PROBS = torch.tensor([0.4, 0.3, 0.2, 0.1])
LOGITS = PROBS.log()


def _draws(params: Sampling, logits=LOGITS, n: int = 400) -> set[int]:
    s = Sampler(params)
    return {s._draw(s.logits(logits)) for _ in range(n)}


def test_top_k_top_p_and_min_p_keep_what_their_definitions_keep():
    assert _draws(Sampling(8, temperature=1.0)) == {0, 1, 2, 3}
    assert _draws(Sampling(8, temperature=1.0, top_k=2)) == {0, 1}
    assert _draws(Sampling(8, temperature=1.0, top_k=-1)) == {0, 1, 2, 3}  # vLLM's "every token"
    # top_p 0.5: 0.4 alone is short of it, 0.3 crosses it and is kept
    assert _draws(Sampling(8, temperature=1.0, top_p=0.5)) == {0, 1}
    assert _draws(Sampling(8, temperature=1.0, top_p=0.7)) == {0, 1}  # 0.4 + 0.3 reaches 0.7
    assert _draws(Sampling(8, temperature=1.0, top_p=1e-9)) == {0}
    # min_p 0.4: below 0.4 × the top token's 0.4 (0.16) is dropped
    assert _draws(Sampling(8, temperature=1.0, min_p=0.4)) == {0, 1, 2}
    assert _draws(Sampling(8, temperature=0.0, top_k=3)) == {0}  # greedy: the argmax


def test_penalties_move_exactly_the_logits_they_name():
    s = Sampler(Sampling(8, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0), prompt=[2])
    s.remember([0, 0, 1], vocab=4)
    row = torch.tensor([1.0, -1.0, 3.0, 0.5])
    out = s.logits(row)
    # repetition over prompt + output (positive / 2, negative × 2), then frequency × count + presence
    assert out.tolist() == pytest.approx([1.0 / 2 - 0.25 * 2 - 0.5, -1.0 * 2 - 0.25 - 0.5, 3.0 / 2, 0.5])
    assert row.tolist() == [1.0, -1.0, 3.0, 0.5]  # the engine's row is left alone
    assert Sampler(Sampling(8)).logits(row) is not None and not Sampling(8).penalized


def test_a_plain_greedy_row_stays_on_its_device_and_a_drawn_one_comes_to_the_host():
    on_device = torch.empty(4096, device="meta")  # stands in for cuda: a copy to the host would fail
    assert Sampler(Sampling(8)).logits(on_device).device.type == "meta"
    assert Sampler(Sampling(8, temperature=0.7)).logits(LOGITS).device.type == "cpu"


def test_the_same_seed_draws_the_same_tokens():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1))

    def run(seed: int) -> list[int]:
        s = Sampler(Sampling(8, temperature=1.0, top_p=0.9, top_k=20, seed=seed, presence_penalty=0.3))
        return [s.sample(logits) for _ in range(30)]

    assert run(7) == run(7) and run(7) != run(8)


@pytest.fixture(scope="module")
def tiny(tiny_ckpt_ro):
    config = load_config(tiny_ckpt_ro)
    layout = PackedLayout(config, ranks=1)
    weights = packed_views(layout, pack_in_memory(Checkpoint.open(tiny_ckpt_ro), layout))
    return build_programs(config, layout, max_seq=128), weights


JOBS = [([3, 17, 250, 9], Sampling(16)),
        ([5, 6, 7], Sampling(16, temperature=0.8, top_p=0.9, seed=1)),
        ([8, 8, 8, 8], Sampling(16, repetition_penalty=1.5, frequency_penalty=0.5)),
        ([40, 41], Sampling(16, temperature=1.2, top_k=5, min_p=0.05, presence_penalty=1.0, seed=2)),
        ([9, 10, 11], Sampling(16))]


def _run(programs, weights, jobs, slots: int, **options) -> list[list[int]]:
    async def main():
        s = Scheduler(Engine(programs, weights, slots=slots), **options)
        try:
            submitted = [s.submit(p, sampling) for p, sampling in jobs]
            return [[t async for t in job] for job in submitted]
        finally:
            s.close()

    return asyncio.run(main())


def test_each_request_keeps_its_tokens_whatever_its_neighbours_ask(tiny):
    programs, weights = tiny
    together = _run(programs, weights, JOBS, slots=len(JOBS))
    alone = [_run(programs, weights, [job], slots=1)[0] for job in JOBS]
    assert together == alone
    # penalised greedy is not plain greedy: the repeated prompt's tokens are pushed down
    plain = _run(programs, weights, [(JOBS[2][0], Sampling(16))], slots=1)[0]
    assert together[2] != plain


def test_speculation_stays_exact_beside_sampled_and_penalised_rows(tiny):
    programs, weights = tiny
    plain = _run(programs, weights, JOBS, slots=len(JOBS))
    drafted = _run(programs, weights, JOBS, slots=len(JOBS), speculative=True)
    assert drafted == plain


@pytest.fixture
def one_thread():
    """One intra-op thread: how several threads split a matmul depends on its rows, so a row's
    last bits (and a sampled draw near a top-p edge) would depend on what it was batched with."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_n_choices_share_one_prefill_and_each_draws_as_its_own_request_would(tiny, one_thread):
    programs, weights = tiny
    prompt = list(range(30, 70))
    samplings = [Sampling(12, temperature=1.0, top_p=0.95, seed=11 + i) for i in range(3)]
    engine = Engine(programs, weights, slots=4)
    rows: list[int] = []
    step = engine.step

    def counting(batch, prefill=None, logits_rows=None):
        rows.append(sum(len(t) for _, t in batch))
        return step(batch, prefill, logits_rows)

    engine.step = counting

    async def main():
        s = Scheduler(engine)
        try:
            jobs = s.submit_group(prompt, samplings)
            return [[t async for t in job] for job in jobs]
        finally:
            s.close()

    together = asyncio.run(main())
    # each as a request of its own (its own prefill), beside the others: the same rows in every
    # decode step, so the same last bits (one thread does not make a GEMV of one row and a GEMM of
    # three round alike: MKL on an Intel cpu does not)
    alone = _run(programs, weights, [(prompt, sp) for sp in samplings], slots=len(samplings))
    assert together == alone and len({tuple(t) for t in together}) > 1
    assert sum(rows) == len(prompt) + 3 * (12 - 1)  # the prompt's rows once, then one row per choice and step
