"""A fake engine for scheduler and service tests: the `runtime.engine.engine.Engine` step interface
without a model. Its n-th generated token in a slot is `base + n`, whatever the prompt."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import torch


class CountingEngine:
    """`gated`: every step waits for a permit (`allow`); `fail_after`: a step that would
    generate a slot's token number `fail_after` raises, as a bug inside a decode step would."""

    def __init__(self, slots: int = 2, base: int = 300, vocab: int = 512, max_seq: int = 64,
                 gated: bool = False, fail_after: int | None = None, rank_slots: list[int] | None = None):
        """`rank_slots`: the engine of a service of several ranks, each owning that many slots."""
        self.base, self.vocab, self.max_seq, self.fail_after = base, vocab, max_seq, fail_after
        if rank_slots is not None:
            slots = sum(rank_slots)
            self.owner = [r for r, n in enumerate(rank_slots) for _ in range(n)]
        self.lengths, self.counts = [0] * slots, [0] * slots
        self.steps = 0
        self.batches: list[int] = []  # sequences per step
        self.modes: list[bool | None] = []  # each step's `prefill`
        self.permits = threading.Semaphore(0) if gated else None

    @property
    def slots(self) -> int:
        return len(self.lengths)

    def idle(self) -> None:
        pass

    def allow(self, n: int) -> None:
        for _ in range(n):
            self.permits.release()

    def reset(self, slot: int = 0) -> None:
        self.lengths[slot] = self.counts[slot] = 0

    def copy_slot(self, src: int, dst: int) -> None:
        """`n` choices share their prompt's prefill: the copy goes on from where `src` is."""
        self.lengths[dst], self.counts[dst] = self.lengths[src], self.counts[src]

    def truncate(self, slot: int, length: int) -> None:
        self.lengths[slot] = min(self.lengths[slot], length)

    def step(self, batch, prefill=None, logits_rows=None):
        """`logits_rows`: each sequence's last logits_rows[i] rows' logits only, as the engine's."""
        if self.permits is not None:
            self.permits.acquire()
        rows = []
        for i, (slot, tokens) in enumerate(batch):
            if self.fail_after is not None and self.counts[slot] >= self.fail_after:
                raise RuntimeError("decode step failed")
            self.lengths[slot] += len(tokens)
            for _ in tokens[len(tokens) - (logits_rows[i] if logits_rows is not None else len(tokens)):]:
                rows.append(torch.nn.functional.one_hot(torch.tensor(self.base + self.counts[slot]),
                                                        self.vocab).float())
            self.counts[slot] += 1
        self.steps += 1
        self.batches.append(len(batch))
        self.modes.append(prefill)
        return SimpleNamespace(logits=torch.stack(rows), hidden=torch.zeros(sum(len(t) for _, t in batch), 1))
