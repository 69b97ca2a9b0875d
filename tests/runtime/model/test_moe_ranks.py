"""Data-parallel attention, expert-parallel MoE at model level: each rank holds only its own
routed experts (a slice of the rank-major layout) and its own sequences' caches; each layer's
routed rows go to their experts' owners and come back; the logits equal one rank holding every
expert and every sequence. The ranks here are threads whose all-to-all is a barrier, so the
arithmetic is tested without processes (tests/test_ranks.py runs real rank processes)."""

import threading

import pytest
import torch

from runtime.engine.dispatch import dispatch_order
from runtime.engine.engine import Engine
from runtime.model.config import load_config
from runtime.programs.calls import engine_runners
from runtime.programs.catalog import build_programs
from runtime.programs.spec import build_function
from runtime.weights.pack import PackedLayout, pack_in_memory, rank_slice
from runtime.weights.views import packed_views
from store.checkpoint import Checkpoint

PROMPTS = [[3, 17, 250, 9, 41, 8, 8, 1], [5, 6, 7], [99, 98, 97, 96, 95, 94]]
SLOTS = 2  # per rank


class ThreadRanks:
    """`world` ranks as threads: an exchange hands each rank the rows the others sent it once all
    have given theirs."""

    def __init__(self, world: int):
        self.world = world
        self.sent: list = [None] * world
        self.barrier = threading.Barrier(world)
        self.exchanges = [0] * world

    def rank(self, r: int):
        ranks = self

        class Member:
            rank, world = r, ranks.world

            def lead(self, *_):
                pass

            def ping(self):
                pass

            def exchange(self, send, counts, recv_counts=None):
                ranks.exchanges[r] += 1
                ranks.sent[r] = (torch.split(send, counts), counts)
                ranks.barrier.wait()
                got = [ranks.sent[q][0][r] for q in range(ranks.world)]
                got_counts = [ranks.sent[q][1][r] for q in range(ranks.world)]
                ranks.barrier.wait()
                assert recv_counts is None or recv_counts == got_counts
                return torch.cat(got), got_counts

        return Member()


def _logits(ckpt, ranks: int, steps: int = 4, programs_run: bool = False) -> tuple[list, ThreadRanks]:
    """Rank 0's logits of PROMPTS prefilled one by one, then decoded together (fixed tokens);
    sequence i sits in global slot 2i+1, so with several ranks they live on different ranks.
    `programs_run`: the engines call the programs' functions (as a launch calls its compiled
    programs: `engine_runners`), not the model's."""
    config = load_config(ckpt)
    layout = PackedLayout(config, ranks)
    programs = build_programs(config, layout, max_seq=64)
    runners = None
    if programs_run:
        runners = engine_runners(programs, {n: build_function(s) for n, s in programs.specs.items()})
    whole = pack_in_memory(Checkpoint.open(ckpt), layout)
    group = ThreadRanks(ranks)
    out: list = [None] * ranks
    slots = [2 * i + 1 for i in range(len(PROMPTS))]

    def run(r: int) -> None:
        own = pack_in_memory(Checkpoint.open(ckpt), layout, rank=r) if r % 2 else rank_slice(layout, whole, r)
        rank_slots = [SLOTS * 4 // ranks] * ranks  # the same slots in all: 8
        engine = Engine(programs, packed_views(layout, own), runners, slots=rank_slots[r],
                        group=group.rank(r) if ranks > 1 else None, rank_slots=rank_slots)
        logits = [engine.forward(torch.tensor(p), slot=s).logits for p, s in zip(PROMPTS, slots, strict=True)]
        for i in range(steps):  # every rank is sent the same tokens (as rank 0 leads them)
            step = engine.step([(s, [7 * i + s]) for s in slots])
            logits += list(step.logits.split(1)) if r == 0 else [None] * len(PROMPTS)
        out[r] = logits

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o is not None for o in out), "a rank thread failed"
    return out[0], group


def test_rows_go_once_to_each_rank_owning_one_of_their_experts():
    idx = torch.tensor([[0, 1], [2, 7], [6, 7], [3, 4]])
    rows, counts = dispatch_order(idx, experts_per_rank=2, world=4)
    assert counts == [1, 2, 1, 2]  # rank 0: row 0 (both experts there, sent once); rank 1: rows 1, 3 …
    assert rows.tolist() == [0, 1, 3, 3, 1, 2]
@pytest.mark.parametrize("ranks", [2, 4])
def test_each_rank_runs_its_own_sequences_and_the_logits_equal_one_ranks(tiny_ckpt_ro, ranks):
    experts = load_config(tiny_ckpt_ro).n_routed_experts
    if experts % ranks:
        pytest.skip(f"tiny has {experts} experts")
    alone, _ = _logits(tiny_ckpt_ro, 1)
    spread, group = _logits(tiny_ckpt_ro, ranks)
    for step, (a, b) in enumerate(zip(alone, spread, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=f"step {step}")
        assert torch.equal(b.argmax(-1), a.argmax(-1))
    # every rank took part in every exchange, those without rows of their own too
    assert len(set(group.exchanges)) == 1 and group.exchanges[0] > 0


def test_ranks_calling_the_experts_programs_compute_what_the_model_does(tiny_ckpt_ro):
    """`experts` runs the way the rows each rank received need (here, op by op: grouped by expert,
    as the model's eager step does): the very same logits."""
    model, _ = _logits(tiny_ckpt_ro, 2)
    programs, _ = _logits(tiny_ckpt_ro, 2, programs_run=True)
    for step, (a, b) in enumerate(zip(model, programs, strict=True)):
        assert torch.equal(b, a), f"step {step}"


def test_a_rank_holds_only_its_experts(tiny_ckpt_ro):
    config = load_config(tiny_ckpt_ro)
    layout = PackedLayout(config, 2)
    whole = pack_in_memory(Checkpoint.open(tiny_ckpt_ro), layout)
    own = pack_in_memory(Checkpoint.open(tiny_ckpt_ro), layout, rank=1)
    for name, t in whole.items():
        if layout.tensors[name].rule.group == "experts":
            assert own[name].shape == (1, *t.shape[1:])
            assert torch.equal(own[name][0], t[1])  # rank 1's packed range, byte for byte
        else:
            assert torch.equal(own[name], t)
    views = packed_views(layout, own)
    assert views["layers.0"]["ffn.experts.w1.qweight"].shape[0] == config.n_routed_experts // 2
