"""What a generation becomes on the wire: settled text with stop strings applied, and the
OpenAI shapes of completions and chat completions, whole or as SSE chunks."""

from __future__ import annotations

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

    `finish` is set at the end: length | stop (a stop string or token) | cancelled | error."""

    def __init__(self, job, tokenizer, stops: list[str] | None):
        self.job, self.ids = job, []
        self.decoder = IncrementalDecoder(tokenizer)
        self.stopper = StopMatcher(stops or [])
        self.finish: str | None = None

    async def pieces(self) -> AsyncIterator[tuple[list[int], str]]:
        """(new token ids, newly settled text) per token; a stop string cancels the job."""
        async for token in self.job:
            self.ids.append(token)
            text, stopped = self.stopper.feed(self.decoder.push(token))
            if stopped:
                self.finish = "stop"
                self.job.cancel()
                yield [token], text
                return
            yield [token], text
        tail, stopped = self.stopper.feed(self.decoder.flush())
        tail += "" if stopped else self.stopper.flush()
        self.finish = "stop" if stopped else self.job.finish_reason
        if tail:
            yield [], tail

    def usage(self) -> dict[str, int]:
        n = len(self.job.prompt)
        return {"prompt_tokens": n, "completion_tokens": len(self.ids), "total_tokens": n + len(self.ids)}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=True, separators=(',', ':'))}\n\n"


class CompletionShape:
    """/v1/completions: text_completion objects; each stream chunk carries its token ids."""

    prefix = "cmpl"

    def __init__(self, model_id: str):
        self.model_id = model_id

    def _body(self, rid: str, choices: list, **extra: Any) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_id,
                "choices": choices, **extra}

    def _choice(self, text: str, ids: list[int], finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": finish}

    def whole(self, rid: str, text: str, run: TextRun) -> dict[str, Any]:
        return self._body(rid, [self._choice(text, run.ids, run.finish)], usage=run.usage())

    def first(self, rid: str) -> tuple:
        return ()

    def delta(self, rid: str, text: str, tokens: list[int]) -> dict[str, Any] | None:
        return self._body(rid, [self._choice(text, tokens, None)])

    def last(self, rid: str, finish: str | None) -> dict[str, Any]:
        return self._body(rid, [self._choice("", [], finish)])

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
    def _delta(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def whole(self, rid: str, text: str, run: TextRun) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": run.finish}], "usage": run.usage()}

    def first(self, rid: str) -> tuple:
        return (self._chunk(rid, [self._delta({"role": "assistant", "content": ""}, None)]),)

    def delta(self, rid: str, text: str, tokens: list[int]) -> dict[str, Any] | None:
        return self._chunk(rid, [self._delta({"content": text}, None)]) if text else None  # no empty deltas

    def last(self, rid: str, finish: str | None) -> dict[str, Any]:
        return self._chunk(rid, [self._delta({}, finish)])

    def usage(self, rid: str, usage: dict[str, int]) -> dict[str, Any]:
        return self._chunk(rid, [], usage=usage)
