"""A generation request's sequences: its prompts (a completions batch, or one), each prompt's
draws (`n`, or `best_of` of which the `n` best are returned), their seeds and their indices.

OpenAI's batch rule: choice k of prompt i is `choices[i × n + k]`. Every prompt is its own group
of sequences (runtime.serve.scheduler.submit_group): placed, prefilled and batched in the engine
as a separate request's would be, so a batch of 8 costs what 8 requests sent at once cost.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from runtime.serve.api import ApiError

SEED_MOD = 1 << 64  # torch.Generator.manual_seed's range


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its token ids, its completion length, and (echo) its text."""

    ids: list[int]
    max_tokens: int
    echo: str | None = None


def draw_seed(seed: int, index: int) -> int:
    """The seed of a request's draw `index`: prompt i's draw k is index i × draws + k, so one
    prompt's choice k draws with seed + k, and the same seed gives the same choices."""
    return (seed + index) % SEED_MOD


def draws_of(sampling, prompt_index: int, prompt: Prompt, draws: int) -> list:
    """The samplings of one prompt's `draws` sequences (runtime.serve.scheduler.Sampling)."""
    first = prompt_index * draws
    return [replace(sampling, max_tokens=prompt.max_tokens, seed=draw_seed(sampling.seed, first + k))
            for k in range(draws)]


def check_fits(scheduler, prompts: int, draws: int, param: str) -> None:
    """A 400 naming `param` when the request's sequences could never run at once: one prompt's
    draws share its prefill on one rank; the prompts of a batch are separate groups."""
    if draws > scheduler.max_group:
        raise ApiError(400, f"{param}: {draws} sequences of one prompt share its prefill on one rank, which holds "
                            f"{scheduler.max_group} at most", param=param)
    if prompts > (most := scheduler.max_groups(draws)):
        raise ApiError(400, f"prompt: a batch of {prompts} prompts × {draws} sequences each; this service holds "
                            f"{most} such prompts at once ({scheduler.slots} sequences)", param="prompt")


def cumulative_logprob(run) -> float:
    """A returned choice's score for best_of: the sum of its tokens' log-probabilities."""
    return sum(lp[0] for lp in run.job.token_logprobs[:len(run.ids)])


def best(runs: list, texts: list[str], n: int, draws: int) -> tuple[list, list[str]]:
    """Of each prompt's `draws` runs (consecutive in `runs`), the `n` with the highest
    cumulative log-probability, best first, indexed prompt × n + rank as OpenAI does."""
    if draws == n:
        return runs, texts
    kept_runs, kept_texts = [], []
    for start in range(0, len(runs), draws):
        ranked = sorted(range(start, start + draws), key=lambda i: -cumulative_logprob(runs[i]))[:n]
        for rank, i in enumerate(ranked):
            runs[i].index = (start // draws) * n + rank
            kept_runs.append(runs[i])
            kept_texts.append(texts[i])
    return kept_runs, kept_texts
