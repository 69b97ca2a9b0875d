"""The scheduler's engine thread: continuous batching, with optional MTP speculation.

Each iteration is one engine step (one call per program) holding every active sequence's next
token, and the prompts of newly admitted jobs packed beside them (a long prompt prefills in its
own step first, so a decode step's per-row work stays small). Then each row's token is sampled
and handed to its job; finished jobs leave, the rest go on in the next step.

MTP speculation (greedy rows): the MTP layer drafts the token after each sequence's pending one;
the step verifies [pending, draft] as two rows of that sequence. The draft is accepted when it
is the token greedy decoding picks at that position, which then also yields the next token from
the draft's row: two tokens for one step. A rejected draft's row is dropped (the slot truncated)
and greedy's own token is used, so the tokens are always those of plain greedy decoding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from runtime.engine.sampling import Sampler, logprobs
from runtime.log import failed

log = logging.getLogger(__name__)
PACK_PROMPT = 128  # prompts up to this many tokens prefill packed into the shared step


class Running:
    """A job on its slot, in the engine thread: its sampler, pending token and draft."""

    def __init__(self, job, slot: int):
        self.job, self.slot = job, slot
        self.sampler = Sampler(job.sampling, job.prompt)
        self.count = 0  # tokens handed to the job
        self.pending: int | None = None  # sampled and handed over, not yet in the caches
        self.draft: int | None = None  # MTP's guess for the token after `pending`
        self.prefilled = False
        # one request's other choices (`n`): they start from this run's prefill, copied
        self.children: list[Running] = []
        self.parent: Running | None = None
        self.ended = False  # told to the scheduler: it runs no more


@dataclass
class MTPRows:
    """What the MTP layer reads for one sequence after a step: the main model's hc streams of
    positions start.., each with the token that followed it."""

    run: Running
    start: int
    hidden: torch.Tensor
    next_tokens: list[int]


@dataclass
class Stats:
    steps: int = 0
    rows: int = 0  # sequence rows over all steps: rows / steps is the batch size
    drafts: int = 0
    accepted: int = 0
    tokens: int = 0  # tokens handed over by decode steps (accepted drafts add one each)
    decoding: int = 0  # sequence-steps that decoded: tokens / decoding is tokens per step

    def to_json(self) -> dict:
        return {"steps": self.steps, "mean_batch": round(self.rows / self.steps, 2) if self.steps else 0.0,
                "drafts": self.drafts, "accepted": self.accepted,
                "acceptance": round(self.accepted / self.drafts, 4) if self.drafts else None,
                "tokens_per_step": round(self.tokens / self.decoding, 3) if self.decoding else None}


def mtp_drafts(engine, rows: list[MTPRows]) -> list[int]:
    """The MTP layer over every sequence's new rows, in one step (a long prompt's in its own
    prefill); each one's draft: the argmax of its last row."""
    drafts: dict[int, int] = {}
    long = [[i] for i, r in enumerate(rows) if len(r.next_tokens) > PACK_PROMPT]
    short = [i for i, r in enumerate(rows) if len(r.next_tokens) <= PACK_PROMPT]
    for group in long + ([short] if short else []):
        part = [rows[i] for i in group]
        logits = engine.mtp_step([(r.run.slot, r.start, r.hidden, r.next_tokens) for r in part],
                                 prefill=len(part[0].next_tokens) > PACK_PROMPT, logits_rows=[1] * len(part))
        drafts.update(zip(group, logits.argmax(-1).tolist(), strict=True))
    return [drafts[i] for i in range(len(rows))]


def _link(admitted: list[Running]) -> None:
    """Admitted choices of one request: the first prefills, the others wait for its prefill."""
    first: dict[int, Running] = {}
    for r in admitted:
        lead = first.setdefault(id(r.job._group), r)
        if lead is not r:
            lead.children.append(r)
            r.parent = lead


class Batcher:
    """Runs steps over `engine`; `end(run, reason)` is told when a job ends (stop, length,
    cancelled, error), `on_token(job)` at every token sampled."""

    def __init__(self, engine, end: Callable[[Running, str], None], on_token: Callable[[object], None],
                 speculative: bool = False, prefill_tokens: int = 512,
                 drafter: Callable[[object, list[MTPRows]], list[int]] = mtp_drafts):
        self.engine, self._end, self.on_token = engine, end, on_token
        self.speculative, self.prefill_tokens, self.drafter = speculative, prefill_tokens, drafter
        self.stats = Stats()

    def take(self, inbox: list) -> int:
        """How many admitted jobs (oldest first) join the next step: within the prompt budget,
        at least one; a request's choices together (they share one prefill)."""
        budget, n = self.prefill_tokens, 0
        while n < len(inbox) and (n == 0 or budget >= len(inbox[n][0].prompt)):
            group = inbox[n][0]._group
            budget -= len(inbox[n][0].prompt)
            n += 1
            while n < len(inbox) and inbox[n][0]._group is group:
                n += 1
        return n

    def step(self, active: list[Running], admitted: list[Running]) -> list[Running]:
        """One iteration: long prompts prefill alone, then one step of everything else. Returns
        the sequences still going. A request's other choices wait for its first choice's
        prefill (in this step) and start from a copy of it."""
        for r in admitted:
            self.engine.reset(r.slot)  # the slot's previous sequence is gone
        _link(admitted)
        runs = [r for r in active + admitted if not r.job.cancelled or self.end(r, "cancelled")]
        for r in [r for r in runs if not r.prefilled and r.parent is None and len(r.job.prompt) > PACK_PROMPT]:
            if not self._run([r], prefill=True):
                runs.remove(r)
        for r in runs:  # a choice whose first choice ended before its prefill prefills its own
            if r.parent is not None and r.parent.ended and not r.prefilled:
                r.parent = None
        runs = [r for r in runs if not r.ended]  # choices forked above may have ended at once
        waiting = [r for r in runs if r.parent is not None]
        stepping = [r for r in runs if r.parent is None]
        # a prompt alone in its step runs the prefill programs, a few percent faster than the
        # same rows packed (`small`, 32 tokens: 251 against 264 ms); with others, packed
        lone = len(stepping) == 1 and not stepping[0].prefilled
        going = self._run(stepping, prefill=lone) if stepping else []
        return going + [r for r in waiting if not r.ended]  # forked now, or still waiting (its lead failed)

    def _rows(self, r: Running) -> list[int]:
        if not r.prefilled:
            return list(r.job.prompt)
        # a draft only when both its tokens may be handed over: two more tokens, and room for
        # the row after them (so the length checks fall where plain decoding's do)
        room = r.job.sampling.max_tokens - r.count >= 2 and self.engine.max_seq - self.engine.lengths[r.slot] >= 3
        if r.draft is not None and room:
            return [r.pending, r.draft]
        r.draft = None
        return [r.pending]

    def _run(self, runs: list[Running], prefill: bool) -> list[Running]:
        """One engine step over `runs`; deliver each one's tokens; the runs still going."""
        batch = [(r.slot, self._rows(r)) for r in runs]
        starts = [self.engine.lengths[r.slot] for r in runs]
        # a prompt's rows need no logits but its last's, unless they are scored (echo)
        wanted = [len(tokens) if r.prefilled or r.job.sampling.prompt_logprobs is not None else 1
                  for r, (_, tokens) in zip(runs, batch, strict=True)]
        try:
            step = self.engine.step(batch, prefill=prefill, logits_rows=wanted)
        except Exception as e:
            failed(log, e, "engine step failed (%d sequences, %d rows)", len(runs), sum(len(t) for _, t in batch))
            return [r for r in runs if self.end(r, "error")]
        decoding = [r for r in runs if r.prefilled]
        if decoding:
            self.stats.steps += 1
            self.stats.rows += len(decoding)
            self.stats.decoding += len(decoding)
        going, mtp = [], []
        offset = logits_at = 0
        for r, (_, tokens), start, n in zip(runs, batch, starts, wanted, strict=True):
            span, logits = slice(offset, offset + len(tokens)), step.logits[logits_at:logits_at + n]
            offset, logits_at = offset + len(tokens), logits_at + n
            first_step = not r.prefilled
            try:
                if self._verify(r, tokens, start, logits, step.hidden[span], mtp):
                    going.append(r)
                if first_step:
                    self._fork(r, logits[-1])
            except Exception as e:  # this sequence's sampling or hand-over: it alone ends, with an error
                failed(log, e, "sequence on slot %d failed after its step", r.slot)
                self.end(r, "error")
                if r in going:
                    going.remove(r)
                for c in r.children:  # forked or not, they share what failed
                    self.end(c, "error")
        if self.speculative and mtp:
            self._draft(mtp)
        return going

    def _verify(self, r: Running, tokens: list[int], start: int, logits, hidden, mtp: list[MTPRows]) -> bool:
        """Hand over this run's tokens from its rows (`logits`: of every row, or of a prompt's
        last alone unless it is scored); queue its MTP rows. False when it ended."""
        first_step = not r.prefilled
        r.prefilled = True
        if first_step and r.job.sampling.prompt_logprobs is not None:  # echo: row i predicts token i + 1
            r.job.prompt_logprobs = logprobs(logits[:-1], tokens[1:], r.job.sampling.prompt_logprobs)
        if first_step and r.job.sampling.max_tokens == 0:
            return self.end(r, "length")
        if r.draft is not None:
            self.stats.drafts += 1
            greedy = int(logits[0].argmax())
            if greedy != r.draft:  # rejected: the draft's row goes, greedy's token stands
                self.engine.truncate(r.slot, start + 1)
                r.draft = None
                return self._hand(r, greedy, first_step, logits[0]) and self._mtp(r, start, hidden[:1], [greedy], mtp)
            self.stats.accepted += 1
            if not self._hand(r, r.draft, first_step, logits[0]):
                return False
            accepted, r.draft = r.draft, None
            nxt = int(logits[1].argmax())
            return self._hand(r, nxt, first_step, logits[1]) and self._mtp(r, start, hidden, [accepted, nxt], mtp)
        token = r.sampler.sample(logits[-1])
        next_tokens = [*tokens[1:], token]  # the token that followed each row
        return self._hand(r, token, first_step, r.sampler.drawn_from) and self._mtp(r, start, hidden, next_tokens, mtp)

    def _fork(self, r: Running, last) -> None:
        """The request's other choices start from `r`'s prefill: its caches copied, their first
        token drawn by their own samplers from its last row."""
        for c in r.children:
            c.parent, c.prefilled = None, True
            if c.ended:
                continue
            if c.job.cancelled:
                self.end(c, "cancelled")
                continue
            self.engine.copy_slot(r.slot, c.slot)
            c.job.prompt_logprobs = r.job.prompt_logprobs
            if c.job.sampling.max_tokens == 0:
                self.end(c, "length")
                continue
            self._hand(c, c.sampler.sample(last), True, c.sampler.drawn_from)
        r.children = []

    def _mtp(self, r: Running, start: int, hidden, next_tokens: list[int], mtp: list[MTPRows]) -> bool:
        # drafts for plain greedy rows only: a draft is verified against the raw argmax
        if self.speculative and r.sampler.plain_greedy:
            mtp.append(MTPRows(r, start, hidden, next_tokens))
        return True

    def _draft(self, mtp: list[MTPRows]) -> None:
        try:
            drafts = self.drafter(self.engine, mtp)
        except Exception as e:  # a draft is an optimisation: without one the sequence decodes plainly
            failed(log, e, "MTP draft failed; decoding without drafts this step")
            return
        for rows, draft in zip(mtp, drafts, strict=True):
            rows.run.draft = int(draft)

    def _hand(self, r: Running, token: int, first_step: bool, logits) -> bool:
        """Hand one token (drawn from `logits`, one row) to the job; False when that ended it."""
        self.on_token(r.job)
        if r.job.cancelled:
            return self.end(r, "cancelled")
        if r.job.sampling.logprobs is not None:
            r.job.token_logprobs += logprobs(logits[None], [token], r.job.sampling.logprobs)
        r.job._emit(token)
        r.count += 1
        if not first_step:
            self.stats.tokens += 1
        if token in r.job.sampling.stop_ids:
            return self.end(r, "stop")
        if r.count >= r.job.sampling.max_tokens or self.engine.lengths[r.slot] >= self.engine.max_seq:
            return self.end(r, "length")
        r.pending = token
        return True

    def end(self, r: Running, reason: str) -> bool:
        if not r.ended:
            r.ended = True
            self._end(r, reason)
        return False
