"""Request bodies of the OpenAI surface: parsed, validated, and every fault a 4xx naming the field.

Torch-free and HTTP-free: `parse_completion` / `parse_chat` take the raw body bytes and return
a validated request or raise ApiError. The service runs them off the event loop.
"""

from __future__ import annotations

import json
import struct
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    ValidationError,
    WithJsonSchema,
)

MAX_TOKENS_LIMIT = 1 << 20
MAX_STOPS, MAX_STOP_CHARS = 16, 256
MAX_MESSAGES = 4096
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
TEMPERATURE_MAX = 2.0  # OpenAI's range
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's presence/frequency penalties
REPETITION_MAX = 10.0  # vLLM takes any > 0; past this every seen token is all but banned
TOP_K_MAX = 1 << 22  # above any vocabulary: every token
MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's chat bound; vLLM's default)
MAX_CHOICES = 128  # `n` and `best_of`; the service bounds them further by the sequences one rank holds
MAX_PROMPTS = 1024  # prompts of one batch; the service bounds it further by the sequences it holds
LOGIT_BIAS_MAX = 100.0  # OpenAI's range: ±100 bans or forces a token
MAX_LOGIT_BIAS = 1024  # tokens one request may bias

# Parameters clients send that this server does not implement: accepted only at their no-op
# value, otherwise a 400 naming them (silently ignoring `tools` or a `suffix` would lie).
NOOP_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}  # fmt: skip
CHAT_NOOP_VALUES = {**NOOP_VALUES, "best_of": (1, None)}  # best_of is the completions API's only


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 kind: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = code or str(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


FLOAT32_TINY = 2.0 ** -126  # float32's smallest normal number (~1.18e-38)


def _float32(v: float) -> float:
    """A sampling number as the sampler computes it (float32): refused when that form is not
    the number asked for — a non-zero value that is 0 or subnormal there (a top_p of 1e-300
    emptied every token's probability and killed the engine thread), or one past its range."""
    if v != 0.0 and abs(v) < FLOAT32_TINY:
        raise ValueError(f"{v!r} is 0 or subnormal in float32, which the sampler computes in; use 0 or at "
                         f"least {FLOAT32_TINY:.3g}")
    try:
        struct.pack("f", v)
    except OverflowError:
        raise ValueError(f"{v!r} is infinite in float32, which the sampler computes in") from None
    return v


def _unicode(s: str) -> str:
    """JSON may carry lone surrogates ("\\ud800"); they are no text and cannot be encoded."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode (it holds a lone surrogate)") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]
# what _float32 refuses, said in the schema: a non-zero number closer to 0 than float32's smallest normal
NOT_SUBNORMAL = {"not": {"anyOf": [{"exclusiveMinimum": 0, "exclusiveMaximum": FLOAT32_TINY},
                                   {"exclusiveMinimum": -FLOAT32_TINY, "exclusiveMaximum": 0}]}}


def f32(**bounds: float) -> Any:
    """A sampling number: a JSON number (not a bool or a string) within `bounds`, finite, and the
    same number in float32 (`_float32`); the OpenAPI document says all of it."""
    return Annotated[float, Field(strict=True, allow_inf_nan=False, json_schema_extra=NOT_SUBNORMAL, **bounds),
                     AfterValidator(_float32)]
StopText = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]


def _stop_list(v: Any) -> Any:
    return [v] if isinstance(v, str) else v


def _logit_bias(v: Any) -> Any:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} → ((id, bias), …) sorted by id
    (the vocabulary bound is the service's to check)."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise ValueError('must be an object mapping token ids to biases, e.g. {"50256": -100}')
    if len(v) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(v)}")
    out = []
    for key, bias in v.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 9):
            raise ValueError(f"keys must be token ids (decimal strings), got {key[:20]!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -LOGIT_BIAS_MAX <= bias <= LOGIT_BIAS_MAX:
            raise ValueError(f"token {key}: the bias must be a number in [-100, 100], got {str(bias)[:20]}")
        try:
            out.append((int(key), _float32(float(bias))))
        except ValueError as e:
            raise ValueError(f"token {key}: {e}") from None
    return tuple(sorted(out))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Text | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: f32(ge=0.0, le=TEMPERATURE_MAX) | None = None
    top_p: f32(gt=0.0, le=1.0) | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=TOP_K_MAX)] | None = None  # vLLM's: -1 or 0 is every token
    min_p: f32(ge=0.0, le=1.0) | None = None
    presence_penalty: f32(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1]) | None = None
    frequency_penalty: f32(ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1]) | None = None
    repetition_penalty: f32(gt=0.0, le=REPETITION_MAX) | None = None
    seed: Annotated[StrictInt, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[list[StopText] | None, Field(max_length=MAX_STOPS), BeforeValidator(_stop_list), WithJsonSchema(
        {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                   {"type": "array", "maxItems": MAX_STOPS,
                    "items": {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}},
                   {"type": "null"}]})] = None
    ignore_eos: StrictBool = False  # vLLM's extension: keep going past the end-of-sequence token
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None
    logit_bias: Annotated[tuple[tuple[int, float], ...], BeforeValidator(_logit_bias), WithJsonSchema(
        {"anyOf": [{"type": "object", "maxProperties": MAX_LOGIT_BIAS, "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                    "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_MAX, "maximum": LOGIT_BIAS_MAX}},
                   {"type": "null"}]})] = ()
    user: Text | None = None


def _requires(*names: str):
    """A JSON schema's `required` for fields the parser insists on past their model default."""
    return lambda schema: schema.__setitem__("required", sorted({*schema.get("required", ()), *names}))


class CompletionRequest(_Common):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_requires("prompt"))
    # a string, a list of token ids, or a batch of either (a list of strings or of id lists):
    # checked by hand for a clear message; `prompts` is the batch, one prompt for the first two
    prompt: Annotated[Any, WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
        {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": {"type": "string", "minLength": 1}},
        {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS,
         "items": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}}]})] = None
    max_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None  # 0: with echo only
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: StrictBool = False
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None
    _prompts: list[str | list[int]] = PrivateAttr(default_factory=list)

    @property
    def prompts(self) -> list[str | list[int]]:
        return self._prompts

    @property
    def draws(self) -> int:
        """Sequences drawn per prompt: best_of of them, of which the n best are returned."""
        return self.best_of or self.n or 1


def _content(v: Any) -> Any:
    """OpenAI content: a string, null, or a list of {"type": "text", "text": …} parts."""
    if v is None or isinstance(v, str):
        return v or ""
    if isinstance(v, list):
        texts = []
        for i, part in enumerate(v):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"part {i} must be {{\"type\": \"text\", \"text\": string}} "
                                 f"(only text content is served)")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError("must be a string or a list of text parts")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: Annotated[Text, BeforeValidator(_content), WithJsonSchema({"anyOf": [
        {"type": "string"}, {"type": "null"},
        {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]})] = ""


class ChatRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None


def _where(loc: tuple) -> str:
    return ".".join(str(p) for p in loc if p != "body") or "body"


def _message(err: dict) -> str:
    msg = err.get("msg", "invalid value")
    return msg.removeprefix("Value error, ")


def _load_object(body: bytes, noops: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    try:
        raw = json.loads(body)
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, 4300+ digit ints, deep nesting
        raise ApiError(400, f"body: not valid JSON ({str(e)[:120]})") from None
    if not isinstance(raw, dict):
        raise ApiError(400, f"body: expected a JSON object, got {type(raw).__name__}")
    for name, ok in noops.items():
        if name in raw and not any(_same(raw[name], v) for v in ok):
            allowed = " or ".join([repr(v) for v in ok if v is not None] + ["absent"])
            raise ApiError(400, f"{name}: not supported by this server (only {allowed})", param=name)
    return raw


def _same(a: Any, b: Any) -> bool:
    if b is None or isinstance(b, bool):
        return a is b
    if isinstance(b, int):
        return isinstance(a, int | float) and not isinstance(a, bool) and a == b
    return type(a) is type(b) and a == b


def _validate(model: type[BaseModel], raw: dict[str, Any]):
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        first = e.errors(include_url=False, include_input=False)[0]
        where = _where(first.get("loc", ()))
        raise ApiError(400, f"{where}: {_message(first)}", param=where) from None
    except RecursionError:
        raise ApiError(400, "body: nested too deeply") from None


def parse_completion(body: bytes) -> CompletionRequest:
    req = _validate(CompletionRequest, _load_object(body, NOOP_VALUES))
    req._prompts = _prompts(req.prompt)
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(400, "max_tokens: 0 generates nothing; it is only served with echo: true", param="max_tokens")
    n = req.n or 1
    if req.best_of is not None and req.best_of < n:
        raise ApiError(400, f"best_of: {req.best_of} must be at least n ({n})", param="best_of")
    if req.stream and req.draws > n:  # OpenAI's rule: the best are known only at the end
        raise ApiError(400, f"best_of: {req.best_of} above n ({n}) cannot stream", param="best_of")
    return req


def _is_ids(p: Any) -> bool:
    return isinstance(p, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in p)


def _prompts(p: Any) -> list[str | list[int]]:
    """The prompts of OpenAI's four forms: a string, a list of token ids, a list of strings, a
    list of token-id lists (the last two a batch)."""
    if isinstance(p, str) or (_is_ids(p) and p):
        batch = [p]
    elif isinstance(p, list) and p and (all(isinstance(x, str) for x in p) or all(_is_ids(x) for x in p)):
        if len(p) > MAX_PROMPTS:
            raise ApiError(400, f"prompt: a batch holds at most {MAX_PROMPTS} prompts, got {len(p)}", param="prompt")
        batch = p
    elif p == []:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    else:
        raise ApiError(400, "prompt: must be a string, a list of token ids, or a batch: a list of strings or "
                            "of token-id lists", param="prompt")
    for i, one in enumerate(batch):
        where = "prompt" if len(batch) == 1 and batch[0] is p else f"prompt.{i}"
        if isinstance(one, str):
            _check_text(one, where)
        elif any(t < 0 for t in one):
            raise ApiError(400, f"{where}: token ids must not be negative", param=where)
        if not one:
            raise ApiError(400, f"{where}: must not be empty", param=where)
    return batch


def _check_text(s: str, where: str) -> None:
    try:
        _unicode(s)
    except ValueError as e:
        raise ApiError(400, f"{where}: {e}", param=where) from None


def parse_chat(body: bytes) -> ChatRequest:
    req = _validate(ChatRequest, _load_object(body, CHAT_NOOP_VALUES))
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    if req.messages[-1].role == "assistant":
        raise ApiError(400, "messages: the last message must be the user's (or a system prompt); continuing "
                            "an assistant message is not served", param="messages")
    return req


def sampling_fields(req: _Common) -> dict[str, Any]:
    """The sampling parameters a request set (runtime.serve.scheduler.Sampling's fields), and
    the log-probabilities it wants: completions' `logprobs: k` (and, with `echo`, the prompt's),
    chat's `logprobs: true` + `top_logprobs: k`."""
    names = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")
    out = {n: getattr(req, n) for n in names if getattr(req, n) not in (None, ())}
    if isinstance(req, CompletionRequest) and req.logprobs is not None:
        out["logprobs"] = req.logprobs
        if req.echo:
            out["prompt_logprobs"] = req.logprobs
    if isinstance(req, ChatRequest) and req.logprobs:
        out["logprobs"] = req.top_logprobs or 0
    return out


def limit_tokens(req: _Common) -> int | None:
    """The requested completion length: max_tokens, else max_completion_tokens, else None."""
    if req.max_tokens is not None:
        return req.max_tokens
    return getattr(req, "max_completion_tokens", None)
