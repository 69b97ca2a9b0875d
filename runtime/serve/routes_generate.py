"""The generation routes: POST /v1/completions and /v1/chat/completions, as a FastAPI router
over the app's `Generation` (`app.state.generation`), not closures.

A generation request is read (capped), parsed and tokenized in a worker thread, submitted to
the scheduler, and answered whole or as SSE; its client leaving cancels its jobs.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from runtime.engine.sampling import Sampling
from runtime.log import Access
from runtime.model import chat_template
from runtime.serve import schema
from runtime.serve.api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    limit_tokens,
    parse_chat,
    parse_completion,
    sampling_fields,
)
from runtime.serve.batch import Prompt, best, check_fits, draws_of
from runtime.serve.http import ClientGone, SafeJSONResponse, access_of, read_body, until_disconnect
from runtime.serve.responses import ChatShape, CompletionShape, TextRun, merged, sse, usage
from runtime.serve.routes_status import Service
from runtime.serve.scheduler import Cancelled, Failed, QueueTimeout

COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions
GENERATION_FAILED = "generation failed; the server log has the details"

router = APIRouter()


class Generation:
    """Prompts in, tokens out, for one service: what the two generation routes run."""

    def __init__(self, service: Service):
        launched = service.launched
        self.service, self.scheduler, self.metrics, self.limits = (service, service.scheduler, service.metrics,
                                                                   service.limits)
        self.tokenizer, self.vocab = launched.tokenizer, launched.config.vocab_size
        self.max_seq = service.max_seq
        self.eos = getattr(self.tokenizer, "eos_id", 1)
        self.completion_shape, self.chat_shape = CompletionShape(service.model_id), ChatShape(service.model_id)

    def unavailable(self, reason: str) -> ApiError:
        return ApiError(503, f"service unavailable: {reason}", kind="service_unavailable", code="service_unavailable")

    def generation_failed(self) -> ApiError:
        """A job the engine ended with an error: 503 when the service has failed as a whole (the
        step died with it), else a 500 — a bug."""
        reason = self.service.failure()
        return self.unavailable(reason) if reason else ApiError(500, GENERATION_FAILED, kind="server_error")

    # ---- request → prompt ids and a completion length (in a worker thread) ----

    def fit(self, ids: list[int], req, field: str, default_tokens: int | None) -> int:
        """The completion length, or a 400 naming the field when the prompt does not fit."""
        if len(ids) >= self.max_seq:
            raise ApiError(400, f"{field}: the prompt is {len(ids)} tokens; max_model_len is {self.max_seq}",
                           param=field)
        room, wanted = self.max_seq - len(ids), limit_tokens(req)
        if wanted is None:
            return min(room, default_tokens) if default_tokens else room
        if wanted > room:
            raise ApiError(400, f"max_tokens: {wanted} past a prompt of {len(ids)} tokens exceeds "
                                f"max_model_len {self.max_seq} (at most {room} fit)", param="max_tokens")
        return wanted

    def completion_prompt(self, body: bytes, access: Access):
        req = parse_completion(body)
        access.model = req.model  # the access line names the model the client asked for, found or not
        self.service.check_model(req.model)
        return req, [self.one_prompt(req, p, "prompt" if p is req.prompt else f"prompt.{i}")
                     for i, p in enumerate(req.prompts)]

    def too_long(self, chars: int, field: str) -> None:
        """A text known to exceed max_model_len before it is tokenized: a token covers at most
        the tokenizer's `max_token_chars` characters, so this many characters are at least
        chars / max_token_chars tokens (a 4 MiB prompt is refused at once, not after seconds
        of tokenizing)."""
        least = -(-chars // max(1, getattr(self.tokenizer, "max_token_chars", 1)))
        if least >= self.max_seq:
            raise ApiError(400, f"{field}: {chars} characters are at least {least} tokens; max_model_len is "
                                f"{self.max_seq}", param=field)

    def one_prompt(self, req, prompt: str | list[int], field: str) -> Prompt:
        if isinstance(prompt, str):
            self.too_long(len(prompt), field)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ApiError(400, f"{field}: encodes to no tokens", param=field)
        if max(ids) >= self.vocab:
            raise ApiError(400, f"{field}: token ids must be below the vocabulary size {self.vocab}", param=field)
        echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) if req.echo else None
        return Prompt(ids, self.fit(ids, req, field, COMPLETION_DEFAULT_TOKENS), echo)

    def chat_prompt(self, body: bytes, access: Access):
        req = parse_chat(body)
        access.model = req.model
        self.service.check_model(req.model)
        self.too_long(sum(len(m.content) for m in req.messages), "messages")
        parts = chat_template.render([(m.role, m.content) for m in req.messages])
        ids = chat_template.encode(self.tokenizer, parts)
        return req, [Prompt(ids, self.fit(ids, req, "messages", None))]

    # ---- one generation request ----

    async def start(self, request: Request, groups: list[list[Sampling]], prompts: list[Prompt]):
        """Submit one group of jobs per prompt (its choices) and wait until they run: the jobs
        and the watcher that cancels every one of them when the client leaves (while queued, too)."""
        jobs = [job for p, samplings in zip(prompts, groups, strict=True)
                for job in self.scheduler.submit_group(p.ids, samplings)]
        watcher = asyncio.ensure_future(until_disconnect(request))
        watcher.add_done_callback(lambda w: None if w.cancelled() else [job.cancel() for job in jobs])
        try:
            for job in jobs:
                await job.started()
        except QueueTimeout as e:
            raise ApiError(503, f"every slot is busy ({e}); retry later", kind="server_busy",
                           code="queue_timeout", headers={"Retry-After": str(e.retry_after)}) from None
        except Cancelled:
            raise ClientGone from None
        except Failed as e:
            raise self.unavailable(str(e)) from None
        finally:
            if any(job.state != "running" for job in jobs):
                for job in jobs:
                    job.cancel()
                watcher.cancel()
        self.metrics.waited(jobs[0].started_at - jobs[0].queued_at)
        return jobs, watcher

    def sampling_of(self, req) -> tuple[Sampling, bool]:
        """The request's sampling, before each draw's length and seed (runtime.serve.batch), and
        whether the client asked for log-probabilities."""
        fields = sampling_fields(req)
        shown = "logprobs" in fields
        if bad := [t for t, _ in fields.get("logit_bias", ()) if t >= self.vocab]:
            raise ApiError(400, f"logit_bias: token {bad[0]} is not below the vocabulary size {self.vocab}",
                           param="logit_bias")
        if getattr(req, "draws", 1) > (req.n or 1):  # best_of ranks its draws by their tokens' logprobs
            fields.setdefault("logprobs", 0)
        return Sampling(max_tokens=0, temperature=req.temperature or 0.0, seed=req.seed or 0,
                        stop_ids=frozenset() if req.ignore_eos else frozenset({self.eos}), **fields), shown

    async def generate(self, request: Request, parse: Callable, shape) -> Any:
        if reason := self.service.failure():
            raise self.unavailable(reason)
        started = time.perf_counter()
        access = access_of(request)
        body = await read_body(request, self.limits.max_body_bytes, self.limits.read_timeout)
        req, prompts = await run_in_threadpool(parse, body, access)
        n, draws = req.n or 1, getattr(req, "draws", req.n or 1)
        check_fits(self.scheduler, len(prompts), draws, "best_of" if draws > n else "n")
        sampling, shown = self.sampling_of(req)
        jobs, watcher = await self.start(request, [draws_of(sampling, i, p, draws) for i, p in enumerate(prompts)],
                                         prompts)
        # draw i is prompt i // draws's; its index, i × n + k as OpenAI's, is best_of's to reassign
        runs = [TextRun(job, self.tokenizer, req.stop, prompts[i // draws].echo, index=i, prompt=i // draws,
                        logprobs=shown) for i, job in enumerate(jobs)]
        rid = f"{shape.prefix}-{uuid.uuid4().hex[:24]}"
        if not access.sent:  # the answer's id names the request in its access line, unless the client named it
            access.id = rid

        def done() -> None:
            for job in jobs:
                job.cancel()
            watcher.cancel()
            counts = self.metrics.account(runs, time.perf_counter() - started)
            access.prompt_tokens, access.completion_tokens = counts["prompt_tokens"], counts["completion_tokens"]
            firsts = [t for job in jobs if (t := getattr(job, "first_token_at", None)) is not None]
            access.ttft = min(firsts) - access.started if firsts else None
            access.finish = ",".join(sorted({run.finish or "cancelled" for run in runs}))

        if not req.stream:
            async def text_of(run: TextRun) -> str:
                return "".join([t async for _, t, _ in run.pieces()])

            try:
                texts = await asyncio.gather(*map(text_of, runs))
            finally:
                done()
            if any(run.finish == "cancelled" for run in runs):
                raise ClientGone
            if any(run.finish == "error" for run in runs):
                raise self.generation_failed()
            # the answer (echoed prompts, logprobs: up to max_model_len entries) is built and
            # encoded off the event loop
            return await run_in_threadpool(lambda: SafeJSONResponse(shape.whole(rid, *best(runs, texts, n, draws),
                                                                                usage(runs))))

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            try:
                for chunk in shape.first(rid, runs):
                    yield sse(chunk)
                async for run, piece in merged(runs):
                    if piece is None:  # this choice ended
                        if run.finish == "error":  # headers are sent: the error travels as an event
                            yield sse(self.generation_failed().body())
                        else:
                            yield sse(shape.last(rid, run))
                        continue
                    tokens, text, lps = piece
                    if chunk := shape.delta(rid, text, tokens, run, lps):
                        yield sse(chunk)
                if include_usage and not any(run.finish == "error" for run in runs):
                    yield sse(shape.usage(rid, usage(runs)))
                yield "data: [DONE]\n\n"
            finally:
                done()

        return StreamingResponse(events(), media_type="text/event-stream")


@router.post("/v1/completions", **schema.generation(CompletionRequest, schema.Completion, schema.Completion))
async def completions(request: Request):
    generation: Generation = request.app.state.generation
    return await generation.generate(request, generation.completion_prompt, generation.completion_shape)


@router.post("/v1/chat/completions", **schema.generation(ChatRequest, schema.ChatCompletion,
                                                         schema.ChatCompletionChunk))
async def chat_completions(request: Request):
    generation: Generation = request.app.state.generation
    return await generation.generate(request, generation.chat_prompt, generation.chat_shape)
