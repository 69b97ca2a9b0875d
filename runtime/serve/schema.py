"""The OpenAPI document's truth: every request body (the pydantic models `runtime.serve.api`
parses with) and every answer, as models a schema-driven client or fuzzer can use.

The generation routes read their bodies by hand (capped, off the event loop), so FastAPI sees no
body parameter: `body_of` declares the request model instead, and `install` adds those models to
the document's components. The answers are described here (`responses`), not produced through
them: the routes build plain dicts, and a test validates real answers against these models.
/metrics is text/plain, /health the contract's `Health` (200 ok, 503 failed or registering).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from runtime.contract import Health
from runtime.serve.api import ChatRequest, CompletionRequest

Finish = Literal["stop", "length", "cancelled", "error"] | None


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Answer):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(_Answer):
    """Every 4xx and 5xx: one sentence naming the field (`param`) where one is at fault."""

    error: ErrorDetail


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Answer):
    tokens: list[str]
    token_logprobs: list[float | None]  # -9999.0 for what float32 calls -inf
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Answer):
    index: int
    text: str
    token_ids: list[int]
    logprobs: CompletionLogprobs | None
    finish_reason: Finish


class Completion(_Answer):
    """/v1/completions: the whole answer, or (streamed) each `data:` chunk (no usage, but in
    the last chunk with `stream_options.include_usage`)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(_Answer):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Answer):
    content: list[TokenLogprob]


class ChatMessageOut(_Answer):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Answer):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Finish


class ChatCompletion(_Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Answer):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Answer):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Finish


class ChatCompletionChunk(_Answer):
    """/v1/chat/completions streamed: each `data:` event."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Answer):
    object: Literal["list"]
    data: list[ModelCard]


REQUESTS = (CompletionRequest, ChatRequest)
STREAMED = (ChatCompletionChunk,)  # named by the event streams' descriptions (a completion's chunk is a Completion)
ERRORS = {
    400: "a field out of range or malformed: the message names it",
    401: "no API key, or a wrong one (`Authorization: Bearer KEY`)",
    404: "no such model",
    408: "the body stopped arriving within --read-timeout",
    413: "the body is over --max-body",
    499: "the client left first (never seen by it: counted in /metrics)",
    500: "a fault of ours: the server log has it",
    503: "the service failed (its reason), or every slot stayed busy for --queue-timeout (Retry-After)",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {"model": ErrorBody, "description": ERRORS[code]} for code in codes}


def generation(request: type[BaseModel], whole: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    """The route options of a generation route: its body, its answers whole and streamed."""
    stream = {"schema": {"type": "string", "description": f"server-sent events: `data: <{chunk.__name__}>` lines, "
                                                          f"then `data: [DONE]`"}}
    return {"openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{request.__name__}"}}}}},
            "responses": {200: {"model": whole, "description": "the answer; with `stream: true`, server-sent events",
                                "content": {"text/event-stream": stream}},
                          **_errors(400, 401, 404, 408, 413, 499, 500, 503)}}


HEALTH = {"responses": {200: {"model": Health, "description": "serving (`status: ok`)"},
                        503: {"model": Health, "description": "failed (its reason) or registering (its phase)"},
                        **_errors(401)}}
METRICS = {"responses": {
    200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}},
    **_errors(401)}}
MODELS = {"responses": {200: {"model": ModelList, "description": "the one model served"}, **_errors(401)}}
MODEL = {"responses": {200: {"model": ModelCard, "description": "the model"}, **_errors(401, 404)}}


def install(app) -> None:
    """Add the request models to `app`'s OpenAPI components (the routes declare them by $ref)."""
    made = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = made()
            _, defs = models_json_schema([*((m, "validation") for m in REQUESTS),
                                          *((m, "serialization") for m in STREAMED)],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        return app.openapi_schema

    app.openapi = openapi
