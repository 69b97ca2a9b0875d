"""One sequence's sampler: OpenAI's and vLLM's sampling parameters over one row of logits.

In vLLM's order: the penalties (repetition over the prompt and the output, frequency and
presence over the output), then the temperature (0: the argmax of the penalised logits), then
top-k, top-p (the smallest set of tokens whose probability reaches p, the one crossing it
kept) and min-p (tokens below min_p × the most likely one's probability dropped), then one
draw from the sequence's own seeded generator. Each sequence has its own sampler, so a
request's parameters never touch another's tokens, and the same seed draws the same tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch


class Sampler:
    """A request's `params` (runtime.serve.scheduler.Sampling) over the rows of its sequence,
    whose prompt is `prompt`."""

    def __init__(self, params, prompt: Iterable[int] = ()):
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)
        self.output: Counter[int] = Counter()  # tokens sampled so far, for the penalties
        self.prompt = frozenset(prompt) if params.repetition_penalty != 1.0 else frozenset()

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the raw logits: what an MTP draft is verified against."""
        return self.params.greedy and not self.params.penalized

    def logits(self, row: torch.Tensor) -> torch.Tensor:
        """The row after the penalties, in float32 (what the token is drawn from)."""
        row = row.float()
        p = self.params
        if not p.penalized:
            return row
        row = row.clone()
        if p.repetition_penalty != 1.0 and (seen := self.prompt | self.output.keys()):
            idx = torch.tensor(sorted(seen), dtype=torch.int64)
            picked = row[idx]
            row[idx] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if self.output and (p.frequency_penalty or p.presence_penalty):
            idx = torch.tensor(list(self.output), dtype=torch.int64)
            counts = torch.tensor(list(self.output.values()), dtype=torch.float32)
            row[idx] -= p.frequency_penalty * counts + p.presence_penalty
        return row

    def sample(self, row: torch.Tensor) -> int:
        """The next token from one row of logits; the sampler remembers it, and the logits it
        drew from (`drawn_from`: penalised, before the temperature)."""
        self.drawn_from = self.logits(row)
        token = self._draw(self.drawn_from)
        self.output[token] += 1
        return token

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        if p.top_p < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            before = ordered.cumsum(-1) - ordered  # probability of the tokens ranked above each
            drop = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, order, before >= p.top_p)
            probs = probs.masked_fill(drop, 0.0)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=self.generator))


LogProb = tuple[float, list[tuple[int, float]]]  # a token's log-probability, and the top k (id, logprob)


def logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[LogProb]:
    """Per row of `logits` [R, V]: the log-probability (float32 log-softmax) of its token, and
    the k most likely tokens with theirs."""
    lp = torch.log_softmax(logits.float(), -1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.int64)[:, None])[:, 0].tolist()
    if not k:
        return [(c, []) for c in chosen]
    top = lp.topk(min(k, lp.shape[-1]), -1)
    return [(c, list(zip(i, v, strict=True))) for c, i, v in zip(chosen, top.indices.tolist(), top.values.tolist(),
                                                                   strict=True)]
