"""The HTTP service: /health, /v1/completions (OpenAI-compatible subset), /metrics.

FastAPI + uvicorn: a real server with request validation for free. Every bad request is a
4xx JSON error in OpenAI's shape; an unexpected failure is logged and answered 500 without
killing the server (the request fuzzing in tests/ checks no 5xx is reachable). Generation
runs in a worker thread on one of the KV slots; requests wait for a free slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)
MAX_TOKENS_LIMIT = 4096


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | list[Annotated[StrictInt, Field(ge=0)]]
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS_LIMIT)] = 16
    temperature: Annotated[float, Field(ge=0.0, le=10.0)] = 0.0
    stream: StrictBool = False
    seed: StrictInt = 0


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


class Metrics:
    def __init__(self, launched) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dsv4_requests", "Completion requests by status", ["status"], registry=r)
        self.tokens = Counter("dsv4_tokens", "Tokens processed", ["kind"], registry=r)
        self.latency = Histogram("dsv4_request_seconds", "Completion latency", registry=r,
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        phase = Gauge("dsv4_registration_phase_seconds", "Registration phase durations", ["phase"], registry=r)
        for name, rec in (launched.phases or {}).items():
            phase.labels(name).set(rec.get("seconds", 0.0))
        programs = Gauge("dsv4_program_cache_programs", "Programs by cache outcome at launch", ["outcome"], registry=r)
        for outcome, n in ((launched.phases.get("programs") or {}).get("counts") or {}).items():
            programs.labels(outcome).set(n)
        weights = launched.phases.get("weights") or {}
        Gauge("dsv4_sidecar_verdict", "1 for the weights path taken at launch", ["path", "reason"],
              registry=r).labels(weights.get("path", "unknown"), weights.get("reason", "")).set(1)
        Gauge("dsv4_kv_slots", "KV cache sequence slots", registry=r).set(len(launched.engines))


def create_app(launched) -> FastAPI:
    """An app serving `launched` (runtime.registration.Launched)."""
    app = FastAPI(title="dsv4", version="1")
    metrics = Metrics(launched)
    slots: asyncio.Queue = asyncio.Queue()
    for engine in launched.engines:
        slots.put_nowait(engine)
    tokenizer, config = launched.tokenizer, launched.config
    model_name = str(launched.options.model_dir)
    max_seq = launched.programs.dims.max_seq

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        metrics.requests.labels("400").inc()
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_name, "slots": len(launched.engines),
                "free_slots": slots.qsize(), "max_seq": max_seq}

    @app.get("/metrics")
    async def metrics_endpoint() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    def _prompt_ids(req: CompletionRequest) -> list[int] | JSONResponse:
        ids = tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        if not ids:
            return _error(400, "prompt: must not be empty")
        if any(i >= config.vocab_size for i in ids):
            return _error(400, f"prompt: token ids must be below the vocabulary size {config.vocab_size}")
        if len(ids) + req.max_tokens > max_seq:
            return _error(400, f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds "
                               f"the context of {max_seq} tokens")
        return ids

    def _body(rid: str, created: int, text: str, ids: list[int], finish: str | None) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "text": text, "token_ids": ids, "finish_reason": finish}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        ids = _prompt_ids(req)
        if isinstance(ids, JSONResponse):
            metrics.requests.labels("400").inc()
            return ids
        rid, created, started = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time()), time.perf_counter()
        engine = await slots.get()
        gen = engine.generate(ids, req.max_tokens, req.temperature, req.seed)
        if not req.stream:
            try:
                out = await run_in_threadpool(list, gen)
            finally:
                slots.put_nowait(engine)
            _account(len(ids), out, started, "200")
            body = _body(rid, created, tokenizer.decode(out), out, "length")
            body["usage"] = {"prompt_tokens": len(ids), "completion_tokens": len(out),
                             "total_tokens": len(ids) + len(out)}
            return body

        async def events() -> AsyncIterator[str]:
            out: list[int] = []
            try:
                while True:
                    token = await run_in_threadpool(next, gen, None)
                    if token is None:
                        break
                    out.append(token)
                    yield f"data: {json.dumps(_body(rid, created, tokenizer.decode([token]), [token], None))}\n\n"
                yield f"data: {json.dumps(_body(rid, created, '', [], 'length'))}\n\n"
                yield "data: [DONE]\n\n"
                _account(len(ids), out, started, "200")
            finally:
                slots.put_nowait(engine)

        return StreamingResponse(events(), media_type="text/event-stream")

    def _account(prompt_tokens: int, out: list[int], started: float, status: str) -> None:
        metrics.requests.labels(status).inc()
        metrics.tokens.labels("prompt").inc(prompt_tokens)
        metrics.tokens.labels("completion").inc(len(out))
        metrics.latency.observe(time.perf_counter() - started)

    return app


def serve(launched, host: str = "127.0.0.1", port: int = 8000, on_ready=None) -> None:
    """Run until SIGTERM/SIGINT: uvicorn drains in-flight requests, then device memory is
    released. `on_ready(url)` is called once the server accepts requests (port 0: any port)."""
    import socket
    import threading

    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        from store.errors import UserError

        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port") from None
    bound = sock.getsockname()[1]
    url = f"http://{'[' + host + ']' if family == socket.AF_INET6 else host}:{bound}"
    config = uvicorn.Config(create_app(launched), log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=30)
    server = uvicorn.Server(config)

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.01)
        if server.started and on_ready:
            on_ready(url)

    threading.Thread(target=announce, daemon=True, name="serve-ready").start()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        launched.close()
