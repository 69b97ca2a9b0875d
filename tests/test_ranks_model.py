"""Expert parallelism at model level: each rank holds only its own routed experts (a slice of
the rank-major layout) and computes its share; the shares summed over ranks give the logits of
one rank holding every expert. The ranks here are threads whose all-reduce is a barrier, so
the arithmetic is tested without processes (tests/test_ranks.py runs real rank processes)."""

import threading

import pytest
import torch

from runtime.model.config import load_config
from runtime.programs.catalog import build_programs
from runtime.serve.engine import Engine
from runtime.weights.pack import PackedLayout, pack_in_memory, rank_slice
from runtime.weights.views import packed_views
from store.checkpoint import Checkpoint

PROMPT = [3, 17, 250, 9, 41, 8, 8, 1]


class ThreadRanks:
    """`world` ranks as threads: reduce sums every rank's tensor once all have given theirs."""

    def __init__(self, world: int):
        self.world = world
        self.parts: list = [None] * world
        self.barrier = threading.Barrier(world)

    def rank(self, r: int):
        ranks = self

        class Member:
            rank, world = r, ranks.world

            def lead(self, *_):
                pass

            def ping(self):
                pass

            def reduce(self, t):
                ranks.parts[r] = t.clone()
                ranks.barrier.wait()
                total = sum(ranks.parts[1:], ranks.parts[0].clone())
                ranks.barrier.wait()
                t.copy_(total)
                return t

        return Member()


def _logits(ckpt, ranks: int, steps: int = 4) -> list[torch.Tensor]:
    config = load_config(ckpt)
    layout = PackedLayout(config, ranks)
    programs = build_programs(config, layout, max_seq=64)
    whole = pack_in_memory(Checkpoint.open(ckpt), layout)
    group = ThreadRanks(ranks)
    out: list = [None] * ranks

    def run(r: int) -> None:
        own = pack_in_memory(Checkpoint.open(ckpt), layout, rank=r) if r % 2 else rank_slice(layout, whole, r)
        engine = Engine(programs, packed_views(layout, own), slots=2, group=group.rank(r) if ranks > 1 else None)
        logits = [engine.forward(torch.tensor(PROMPT), slot=1).logits]
        for _ in range(steps):
            token = int(logits[-1][-1].argmax())
            logits.append(engine.step([(1, [token])]).logits)
        out[r] = logits

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o is not None for o in out), "a rank thread failed"
    return out


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_ranks_sum_to_one_rank(tiny_ckpt_ro, ranks):
    experts = load_config(tiny_ckpt_ro).n_routed_experts
    if experts % ranks:
        pytest.skip(f"tiny has {experts} experts")
    (alone,) = _logits(tiny_ckpt_ro, 1)
    per_rank = _logits(tiny_ckpt_ro, ranks)
    for r, logits in enumerate(per_rank):
        for step, (a, b) in enumerate(zip(alone, logits, strict=True)):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=f"rank {r} step {step}")
            assert torch.equal(b.argmax(-1), a.argmax(-1))


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
