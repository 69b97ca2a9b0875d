"""One sequence's sampler: OpenAI's and vLLM's sampling parameters over one row of logits.

In vLLM's order: OpenAI's logit_bias (added to the raw logits), the penalties (repetition over the
prompt and the output, frequency and presence over the output), then the temperature (0: the argmax
of the penalised logits), then top-k, top-p (the smallest set of tokens whose probability reaches p,
the one crossing it kept) and min-p (tokens below min_p × the most likely one's probability dropped), then one
draw from the sequence's own seeded generator. Each sequence has its own sampler, so a
request's parameters never touch another's tokens, and the same seed draws the same tokens.

Numbers at their extremes stay numbers: the service admits only parameters whose float32 form is
normal (runtime.serve.api), and a penalty or temperature that still pushes a logit past float32's
range is held at its largest finite value (`finite`), so a draw never meets inf - inf = NaN.
Log-probabilities below LOGPROB_FLOOR are written as it (OpenAI's and vLLM's -9999.0): never -inf.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # temperatures below this sample like 0 (their limit), never divide by ~0


@dataclass(frozen=True)
class Sampling:
    """A job's length, stop tokens and sampling parameters (OpenAI's and vLLM's; defaults: off;
    `Sampler` applies them)."""

    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stop_ids: frozenset[int] = frozenset()  # a token that ends the job (eos) after being emitted
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit), OpenAI's
    logprobs: int | None = None  # each generated token's log-probability and this many top ones
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (echo)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """The logits are changed before the draw (a bias or a penalty): not the raw argmax."""
        return self.penalized or bool(self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


FLOAT32_MAX = torch.finfo(torch.float32).max
LOGPROB_FLOOR = -9999.0


def finite(row: torch.Tensor) -> torch.Tensor:
    """Logits with ±inf held at float32's largest finite value (NaN, a fault upstream, stays)."""
    return row.clamp(-FLOAT32_MAX, FLOAT32_MAX)


class Sampler:
    """A request's `params` (runtime.serve.scheduler.Sampling) over the rows of its sequence,
    whose prompt is `prompt`. The penalties' state is two vocabulary-sized vectors (counts of
    the output, tokens seen), updated as tokens are drawn: a step's penalty is a few vector ops,
    never a walk over the sequence."""

    def __init__(self, params, prompt: Iterable[int] = ()):
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)
        self._prompt = list(prompt) if params.repetition_penalty != 1.0 else []
        self.counts: torch.Tensor | None = None  # [V] float32: each token's count in the output
        self.seen: torch.Tensor | None = None  # [V] bool: in the prompt or the output
        self.drawn_from: torch.Tensor | None = None
        bias = params.logit_bias
        self._bias = (torch.tensor([t for t, _ in bias], dtype=torch.int64),
                      torch.tensor([b for _, b in bias], dtype=torch.float32)) if bias else None

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the raw logits: what an MTP draft is verified against."""
        return self.params.greedy and not self.params.processed

    def remember(self, tokens: Iterable[int], vocab: int) -> None:
        """Tokens of the output, for the penalties."""
        if not self.params.penalized:
            return
        if self.counts is None:
            self.counts = torch.zeros(vocab)
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.seen[torch.tensor(self._prompt, dtype=torch.int64)] = True
        for t in tokens:
            self.counts[t] += 1
            self.seen[t] = True

    def logits(self, row: torch.Tensor) -> torch.Tensor:
        """The row after the bias and the penalties, in float32: what the token is drawn from. A
        plain greedy row stays where it is (only its argmax comes back: 8 bytes, not a vocabulary
        of floats per sequence and step); any other comes to the host, whose generator draws from it."""
        p = self.params
        if not p.processed and p.greedy:
            return row.float()
        row = row.float().cpu()
        if self._bias is not None:  # a few entries: one indexed add, never a vocabulary-sized vector
            row = row.index_add(0, *self._bias)
        if not p.penalized:
            return row
        self.remember((), row.shape[-1])
        if p.repetition_penalty != 1.0:
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(self.seen, scaled, row)
        if p.frequency_penalty or p.presence_penalty:
            row = row - p.frequency_penalty * self.counts - p.presence_penalty * (self.counts > 0)
        return finite(row)

    def sample(self, row: torch.Tensor) -> int:
        """The next token from one row of logits; the sampler remembers it, and the logits it
        drew from (`drawn_from`: penalised, before the temperature)."""
        self.drawn_from = self.logits(row)
        token = self._draw(self.drawn_from)
        self.remember((token,), row.shape[-1])
        return token

    def _draw(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = finite(logits / p.temperature)
        if 0 < p.top_k < logits.shape[-1]:  # the k candidates, most likely first
            logits, ids = torch.topk(logits, p.top_k)
        elif p.top_p < 1.0:
            logits, ids = torch.sort(logits, descending=True)
        else:
            ids = None
        probs = torch.softmax(logits, -1)
        if p.top_p < 1.0:  # probs are in descending order here
            probs = probs.masked_fill(probs.cumsum(-1) - probs >= p.top_p, 0.0)  # the mass ranked above each
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        choice = int(torch.multinomial(probs, 1, generator=self.generator))
        return choice if ids is None else int(ids[choice])


LogProb = tuple[float, list[tuple[int, float]]]  # a token's log-probability, and the top k (id, logprob)


def logprobs(logits: torch.Tensor, tokens: list[int], k: int) -> list[LogProb]:
    """Per row of `logits` [R, V]: the log-probability (float32 log-softmax) of its token, and
    the k most likely tokens with theirs; each at least LOGPROB_FLOOR, so JSON can carry it."""
    lp = torch.nan_to_num(torch.log_softmax(logits.float(), -1), nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp(
        min=LOGPROB_FLOOR)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.int64, device=lp.device)[:, None])[:, 0].tolist()
    if not k:
        return [(c, []) for c in chosen]
    top = lp.topk(min(k, lp.shape[-1]), -1)
    return [(c, list(zip(i, v, strict=True))) for c, i, v in zip(chosen, top.indices.tolist(), top.values.tolist(),
                                                                   strict=True)]
