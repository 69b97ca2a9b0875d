"""What a generation becomes on the wire: settled text with stop strings applied, and the
OpenAI shapes of completions and chat completions, whole or as SSE chunks."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from runtime.model.tokenizer import IncrementalDecoder


class StopMatcher:
    """Finds the first of `stops` in generated text; holds back a tail that may start one."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._re = re.compile("|".join(re.escape(s) for s in self.stops)) if self.stops else None
        self.text = ""  # everything seen
        self.sent = 0  # chars of `text` already released

    def feed(self, new: str) -> tuple[str, bool]:
        """(text safe to release now, whether a stop string was reached)."""
        start = max(0, len(self.text) - self._hold)
        self.text += new
        if self._re is not None:
            m = self._re.search(self.text, start)
            if m:
                out = self.text[self.sent:m.start()]
                self.sent = m.start()
                self.text = self.text[:m.start()]
                return out, True
        upto = len(self.text) - self._hold if self._re is not None else len(self.text)
        out = self.text[self.sent:upto] if upto > self.sent else ""
        self.sent = max(self.sent, upto)
        return out, False

    def flush(self) -> str:
        """The held-back tail, once generation ended without a stop."""
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


class TextRun:
    """The tokens of one job turned into settled text, honouring stop strings.

    `finish` is set at the end: length | stop (a stop string or token) | cancelled | error.
    `echo`: the prompt's text, shown before the completion (completions' `echo: true`); `index`:
    the choice's place in the answer; `prompt`: which of a batch's prompts it continues;
    `logprobs`: whether they are shown (default: whether the job computes them; best_of's
    draws compute them to rank themselves)."""

    def __init__(self, job, tokenizer, stops: list[str] | None, echo: str | None = None, index: int = 0,
                 prompt: int = 0, logprobs: bool | None = None):
        self.job, self.ids, self.tokenizer, self.echo, self.index = job, [], tokenizer, echo, index
        self.prompt = prompt
        self.wants_logprobs = job.sampling.logprobs is not None if logprobs is None else logprobs
        self.decoder = IncrementalDecoder(tokenizer)
        self.stopper = StopMatcher(stops or [])
        self.finish: str | None = None
        self.offset = 0  # text_offset of the next token streamed
        self.echo_pending = echo is not None  # a stream's first chunk of this choice carries the prompt

    async def pieces(self) -> AsyncIterator[tuple[list[int], str, list]]:
        """(new token ids, newly settled text, their log-probabilities when asked for) per token;
        a stop string cancels the job."""
        async for token in self.job:
            self.ids.append(token)
            lps = self.job.token_logprobs[len(self.ids) - 1:len(self.ids)]
            text, stopped = self.stopper.feed(self.decoder.push(token))
            if stopped:
                self.finish = "stop"
                self.job.cancel()
                yield [token], text, lps
                return
            yield [token], text, lps
        tail, stopped = self.stopper.feed(self.decoder.flush())
        tail += "" if stopped else self.stopper.flush()
        self.finish = "stop" if stopped else self.job.finish_reason
        if tail:
            yield [], tail, []

    def prompt_entries(self) -> list[tuple[int, Any]]:
        """The prompt's tokens with their log-probabilities (the first has none)."""
        prompt = self.job.prompt
        return [(prompt[0], None), *zip(prompt[1:], self.job.prompt_logprobs or [], strict=False)]

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def completion_logprobs(self, entries: list[tuple[int, Any]]) -> dict[str, Any]:
        """OpenAI's completion logprobs of (token, LogProb or None) entries, from `offset` on:
        the sampled token is always among its top ones."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in entries:
            piece = self.token_text(token)
            out["tokens"].append(piece)
            out["text_offset"].append(self.offset)
            self.offset += len(piece)
            out["token_logprobs"].append(None if lp is None else lp[0])
            out["top_logprobs"].append(None if lp is None else
                                       {**{self.token_text(i): v for i, v in lp[1]}, piece: lp[0]})
        return out

    def chat_logprobs(self, entries: list[tuple[int, Any]]) -> dict[str, Any]:
        """OpenAI's chat logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        def one(token: int, logprob: float) -> dict[str, Any]:
            piece = self.token_text(token)
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode())}

        return {"content": [{**one(t, lp[0]), "top_logprobs": [one(i, v) for i, v in lp[1]]} for t, lp in entries]}

    def entries(self) -> list[tuple[int, Any]]:
        """Every generated token with its log-probability."""
        return list(zip(self.ids, self.job.token_logprobs, strict=False))

    def echoed(self, text: str, entries: list) -> tuple[str, list]:
        """The choice's text and logprob entries, the prompt's before them the first time (the
        whole answer, or a stream's first chunk of this choice)."""
        if not self.echo_pending:
            return text, entries
        self.echo_pending = False
        return self.echo + text, self.prompt_entries() + entries


def usage(runs: list[TextRun]) -> dict[str, int]:
    """One request's tokens: each of its prompts once, every drawn sequence's completion
    (best_of's unreturned ones too: they were generated, as OpenAI bills them)."""
    n = sum({r.prompt: len(r.job.prompt) for r in runs}.values())
    done = sum(len(r.ids) for r in runs)
    return {"prompt_tokens": n, "completion_tokens": done, "total_tokens": n + done}


async def merged(runs: list[TextRun]) -> AsyncIterator[tuple[TextRun, tuple | None]]:
    """Every choice's pieces as they come: (run, piece), and (run, None) when that one ends."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: TextRun) -> None:
        try:
            async for piece in run.pieces():
                await queue.put((run, piece))
        finally:
            await queue.put((run, None))

    tasks = [asyncio.ensure_future(pump(r)) for r in runs]
    try:
        for _ in runs:
            while (item := await queue.get())[1] is not None:
                yield item
            yield item
    finally:
        for t in tasks:
            t.cancel()

def sse(obj: dict[str, Any]) -> str:
    """One server-sent event: JSON only (NaN or infinity raise here, never reach a client)."""
    return f"data: {json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(',', ':'))}\n\n"


class CompletionShape:
    """/v1/completions: text_completion objects; each stream chunk carries its token ids."""

    prefix = "cmpl"

    def __init__(self, model_id: str):
        self.model_id = model_id

    def _body(self, rid: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_id,
                "choices": choices, **extra}

    @staticmethod
    def _choice(run: TextRun, text: str, ids: list[int], finish: str | None, logprobs: dict | None = None) -> dict:
        return {"index": run.index, "text": text, "token_ids": ids, "logprobs": logprobs, "finish_reason": finish}

    def whole(self, rid: str, runs: list[TextRun], texts: list[str], usage: dict[str, int]) -> dict[str, Any]:
        choices = []
        for run, text in zip(runs, texts, strict=True):
            text, entries = run.echoed(text, run.entries())
            logprobs = run.completion_logprobs(entries) if run.wants_logprobs else None
            choices.append(self._choice(run, text, run.ids, run.finish, logprobs))
        return self._body(rid, choices, usage=usage)

    def first(self, rid: str, runs: list[TextRun]) -> tuple:
        return ()

    def delta(self, rid: str, text: str, tokens: list[int], run: TextRun, lps: list) -> dict[str, Any] | None:
        text, entries = run.echoed(text, list(zip(tokens, lps, strict=False)))
        logprobs = run.completion_logprobs(entries) if run.wants_logprobs else None
        return self._body(rid, [self._choice(run, text, tokens, None, logprobs)])

    def last(self, rid: str, run: TextRun) -> dict[str, Any]:
        text, entries = run.echoed("", [])  # max_tokens 0: the prompt alone
        logprobs = run.completion_logprobs(entries) if run.wants_logprobs and entries else None
        return self._body(rid, [self._choice(run, text, [], run.finish, logprobs)])

    def usage(self, rid: str, usage: dict[str, int]) -> dict[str, Any]:
        return self._body(rid, [], usage=usage)


class ChatShape:
    """/v1/chat/completions: chat.completion, and chat.completion.chunk deltas (role first)."""

    prefix = "chatcmpl"

    def __init__(self, model_id: str):
        self.model_id = model_id

    def _chunk(self, rid: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_id, "choices": choices, **extra}

    @staticmethod
    def _delta(run: TextRun, delta: dict[str, Any], finish: str | None, logprobs: dict | None = None) -> dict:
        return {"index": run.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def whole(self, rid: str, runs: list[TextRun], texts: list[str], usage: dict[str, int]) -> dict[str, Any]:
        choices = []
        for run, text in zip(runs, texts, strict=True):
            logprobs = run.chat_logprobs(run.entries()) if run.wants_logprobs else None
            choices.append({"index": run.index, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs, "finish_reason": run.finish})
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_id,
                "choices": choices, "usage": usage}

    def first(self, rid: str, runs: list[TextRun]) -> tuple:
        return tuple(self._chunk(rid, [self._delta(run, {"role": "assistant", "content": ""}, None)]) for run in runs)

    def delta(self, rid: str, text: str, tokens: list[int], run: TextRun, lps: list) -> dict[str, Any] | None:
        logprobs = run.chat_logprobs(list(zip(tokens, lps, strict=True))) if run.wants_logprobs and lps else None
        if not text and logprobs is None:
            return None  # no empty deltas
        return self._chunk(rid, [self._delta(run, {"content": text}, None, logprobs)])

    def last(self, rid: str, run: TextRun) -> dict[str, Any]:
        return self._chunk(rid, [self._delta(run, {}, run.finish)])

    def usage(self, rid: str, usage: dict[str, int]) -> dict[str, Any]:
        return self._chunk(rid, [], usage=usage)
