"""Continuous batching through the scheduler on the tiny model: jobs arrive while others decode,
decode together in one call per program, and leave on their own; each gets exactly the tokens
it gets alone (greedy, and sampled with its seed)."""

import asyncio
import threading

import pytest
import torch
from engine_fakes import CountingEngine

from runtime.engine.engine import Engine
from runtime.engine.sampling import Sampling
from runtime.model.config import load_config
from runtime.programs.catalog import build_programs
from runtime.serve.scheduler import Scheduler
from runtime.weights.pack import PackedLayout, pack_in_memory
from runtime.weights.views import packed_views
from store.checkpoint import Checkpoint

# short prompts pack beside the decoding rows; the 150-token one prefills alone first
PROMPTS = [[3, 17, 250, 9, 41], list(range(60, 83)), [7] * 9, list(range(100, 250)), [1, 2], list(range(200, 240))]
LENGTHS = [12, 5, 14, 9, 20, 3]


@pytest.fixture(scope="module")
def tiny(tiny_ckpt_ro):
    config = load_config(tiny_ckpt_ro)
    layout = PackedLayout(config, ranks=1)
    return build_programs(config, layout, max_seq=256), \
        packed_views(layout, pack_in_memory(Checkpoint.open(tiny_ckpt_ro), layout))


def _alone(programs, weights, prompt, n, temperature=0.0, seed=0):
    return list(Engine(programs, weights).generate(prompt, n, temperature, seed))


async def _staggered(scheduler, jobs):
    """Submit each job once the previous one has produced a token: arrivals between steps."""
    submitted, results = [], []

    async def collect(job):
        return [t async for t in job]

    for prompt, sampling in jobs:
        job = scheduler.submit(prompt, sampling)
        it = job.__aiter__()
        first = await it.__anext__()
        submitted.append((job, first, it))
    for job, first, it in submitted:
        results.append(([first] + [t async for t in it], job.finish_reason))
    return results


def _batched(programs, weights, jobs, **options):
    async def main():
        s = Scheduler(Engine(programs, weights, slots=4), **options)
        try:
            return await _staggered(s, jobs), s.stats
        finally:
            s.close()

    return asyncio.run(main())


def _jobs(temperature=0.0):
    return [(p, Sampling(max_tokens=n, temperature=temperature, seed=i))
            for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True))]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_interleaved_jobs_get_the_tokens_they_get_alone(tiny, temperature):
    programs, weights = tiny
    jobs = _jobs(temperature)
    results, stats = _batched(programs, weights, jobs)
    want = [_alone(programs, weights, p, s.max_tokens, temperature, s.seed) for p, s in jobs]
    assert [tokens for tokens, _ in results] == want
    assert all(reason == "length" for _, reason in results)
    assert stats["mean_batch"] > 1.5  # they really decoded together


def test_mtp_speculation_keeps_greedy_tokens(tiny):
    """The MTP layer drafts, the main model verifies: whatever is accepted or rejected (the
    synthetic MTP layer's random weights draft badly), the tokens are greedy's."""
    programs, weights = tiny
    jobs = _jobs()
    results, stats = _batched(programs, weights, jobs, speculative=True)
    assert [tokens for tokens, _ in results] == [_alone(programs, weights, p, s.max_tokens) for p, s in jobs]
    assert stats["drafts"] > 0 and stats["acceptance"] is not None


def test_accepted_drafts_yield_two_tokens_a_step_and_the_same_tokens(tiny):
    """A drafter that is right two times in three (the true greedy next token, else a wrong
    one) exercises both paths: accepted drafts hand over two tokens for one step, rejected
    ones are dropped, and every job's tokens are still greedy's."""
    programs, weights = tiny
    jobs = _jobs()
    want = {tuple(p): _alone(programs, weights, p, s.max_tokens + 2) for p, s in jobs}

    def oracle(engine, rows):
        drafts = []
        for r in rows:
            truth = want[tuple(r.run.job.prompt)][r.run.count]  # the token after the pending one
            drafts.append(truth if r.run.count % 3 else (truth + 1) % programs.dims.vocab)
        return drafts

    results, stats = _batched(programs, weights, jobs, speculative=True, drafter=oracle)
    assert [tokens for tokens, _ in results] == [want[tuple(p)][:s.max_tokens] for p, s in jobs]
    assert 0 < stats["accepted"] < stats["drafts"]
    assert stats["tokens_per_step"] > 1.2


def test_finished_sequences_leave_and_queued_ones_take_their_slots():
    engine = CountingEngine(slots=2, base=100)

    async def main():
        s = Scheduler(engine)
        jobs = [s.submit([1], Sampling(max_tokens=n)) for n in (2, 6, 3, 1)]
        out = [[t async for t in job] for job in jobs]
        s.close()
        return out

    assert asyncio.run(main()) == [[100, 101], [100, 101, 102, 103, 104, 105], [100, 101, 102], [100]]
    assert max(engine.batches) == 2 and engine.slots == 2


def test_an_idle_engine_gathers_a_burst_into_its_first_step():
    """Jobs arriving within the gap of each other reach an idle engine's first step together,
    their prompts packed; a prompt alone in its step runs as a prefill."""
    engine = CountingEngine(slots=4, base=100)

    async def main():
        s = Scheduler(engine, gather=(0.5, 5.0))  # a wide gap: the event loop's own delays never split the burst
        jobs = []
        for _ in range(3):
            jobs.append(s.submit([1], Sampling(max_tokens=4)))
            await asyncio.sleep(0.01)
        out = [[t async for t in job] for job in jobs]
        late = [t async for t in s.submit([1], Sampling(max_tokens=2))]
        s.close()
        return out, late

    out, late = asyncio.run(main())
    assert out == [[100, 101, 102, 103]] * 3 and late == [100, 101]
    assert engine.batches[:4] == [3, 3, 3, 3] and engine.batches[4:] == [1, 1]
    assert engine.modes == [False] * 4 + [True, False]


def test_a_job_goes_to_the_rank_with_the_most_free_slots_then_the_least_work():
    engine = CountingEngine(rank_slots=[2, 3, 1], gated=True)

    async def main():
        s = Scheduler(engine)
        placed = []
        for n in (5, 9, 2, 7, 1):
            s.submit([1], Sampling(max_tokens=n))
            placed.append([r["running"] for r in s.per_rank()])
        per_rank = s.per_rank()
        engine.allow(100)
        s.close()
        return placed, per_rank, s.slots

    placed, per_rank, slots = asyncio.run(main())
    assert placed == [[0, 1, 0],  # rank 1: three free slots
                      [1, 1, 0],  # ranks 0 and 1 have two free: rank 0 has no work yet
                      [1, 2, 0],  # rank 1: two free
                      [1, 2, 1],  # one free each: rank 2 has no work
                      [1, 3, 1]]  # one free each on ranks 0 and 1: rank 1 has less work (6 + 3 tokens vs 10)
    assert slots == 6 and [(r["rank"], r["slots"], r["free_slots"]) for r in per_rank] == \
        [(0, 2, 1), (1, 3, 0), (2, 1, 0)]


def test_a_failed_service_fails_its_queued_jobs_at_once_and_admits_none():
    from runtime.serve.scheduler import Failed

    engine = CountingEngine(slots=1, gated=True)

    async def main():
        s = Scheduler(engine, queue_timeout=600)
        running = s.submit([1], Sampling(max_tokens=50))
        queued = [s.submit([1], Sampling(max_tokens=2)) for _ in range(3)]
        await running.started()
        threading.Thread(target=s.fail, args=("rank 1 on host-b (pid 7) stopped answering",)).start()
        outcomes = []
        for job in queued:
            with pytest.raises(Failed, match="rank 1 on host-b"):
                await asyncio.wait_for(job.started(), 30)  # at once: not after the queue time
            outcomes.append(job.state)
        late = s.submit([1], Sampling(max_tokens=2))
        with pytest.raises(Failed):
            await late.started()
        engine.allow(100)
        s.close()
        return outcomes

    assert asyncio.run(main()) == ["failed"] * 3


def test_one_sequence_per_step_is_the_baseline():
    engine = CountingEngine(slots=4, base=100)

    async def main():
        s = Scheduler(engine, max_batch=1)
        jobs = [s.submit([1], Sampling(max_tokens=3)) for _ in range(3)]
        out = [[t async for t in job] for job in jobs]
        s.close()
        return out, s.slots

    out, slots = asyncio.run(main())
    assert out == [[100, 101, 102]] * 3 and slots == 1 and max(engine.batches) == 1


def test_a_step_at_max_seq_ends_the_job_with_length():
    engine = CountingEngine(slots=1, base=100, max_seq=6)

    async def main():
        s = Scheduler(engine)
        job = s.submit([1, 2, 3, 4], Sampling(max_tokens=50))
        out = [t async for t in job]
        s.close()
        return out, job.finish_reason

    assert asyncio.run(main()) == ([100, 101, 102], "length")  # 4 prompt + 2 appended = max_seq
    assert torch.tensor(engine.lengths).max().item() == 6
