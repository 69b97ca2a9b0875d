"""The app: the service's value (`runtime.serve.routes_status.Service`: launch, scheduler,
metrics, identity) and its two routers — /health, /metrics and /v1/models
(`routes_status`), /v1/completions and /v1/chat/completions (`routes_generate`) — with the
error handlers every route shares."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.launch.spec import DEFAULTS
from runtime.serve import schema
from runtime.serve.api import ApiError
from runtime.serve.auth import OPEN_DOOR, Door, RequireKey
from runtime.serve.http import (
    CLIENT_GONE,
    AccessLog,
    ClientGone,
    SafeJSONResponse,
    access_of,
    error_response,
)
from runtime.serve.metrics import Metrics
from runtime.serve.routes_generate import Generation
from runtime.serve.routes_generate import router as generation_routes
from runtime.serve.routes_status import Service
from runtime.serve.routes_status import router as status_routes
from runtime.serve.scheduler import Scheduler


@dataclass(frozen=True)
class Limits:
    """What the service accepts, and how its engine thread batches (defaults: the launch spec's)."""

    max_body_bytes: int = DEFAULTS.max_body
    queue_timeout: float = DEFAULTS.queue_timeout
    max_batch: int | None = DEFAULTS.max_batch  # sequences decoding together (None: every KV slot)
    speculative: bool = False  # MTP drafts verified by the main model (greedy requests)
    read_timeout: float = DEFAULTS.read_timeout  # a request's head, and each piece of its body

    @classmethod
    def of(cls, spec, speculative: bool) -> Limits:
        return cls(spec.max_body, spec.queue_timeout, spec.max_batch, speculative, spec.read_timeout)


def create_app(launched, limits: Limits = Limits(), scheduler: Scheduler | None = None, door: Door = OPEN_DOOR,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """An app serving `launched` (runtime.launch.launched.Launched) through `scheduler` (by
    default continuous batching over every KV slot of launched.engine), behind `door` (its API
    keys: runtime.serve.auth). `on_fatal(reason)`: the engine thread died (default
    `launched.fail`: 503 from then on; `dsv4 serve` also exits non-zero)."""
    app = FastAPI(title="dsv4", version="1", default_response_class=SafeJSONResponse)
    scheduler = scheduler or Scheduler(launched.engine, limits.queue_timeout, limits.max_batch, limits.speculative)
    app.state.scheduler = scheduler
    if hasattr(launched, "on_failure"):  # a failed service fails its queued requests at once (503)
        launched.on_failure(scheduler.fail)
    scheduler.on_fatal = on_fatal or getattr(launched, "fail", scheduler.on_fatal)
    metrics = Metrics(launched, scheduler)
    scheduler.on_token = metrics.on_token
    app.state.service = service = Service(launched, scheduler, metrics, limits)
    metrics.watch_ranks(service.ranks)
    app.include_router(status_routes)
    if door.keys:
        app.add_middleware(RequireKey, door=door, count=metrics.count_key)
    app.add_middleware(AccessLog, count=metrics.count_response)  # outermost: 401s are counted and said too

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> SafeJSONResponse:
        access_of(request).error = exc.message
        return error_response(exc)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, _exc: ClientGone) -> Response:
        access_of(request).error = "the client left before its answer"
        return Response(status_code=CLIENT_GONE)  # nobody reads it: it is for the metrics and the log

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> SafeJSONResponse:
        access_of(request).error = str(exc.detail)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code),
                                       headers=dict(exc.headers or {})))  # a 405's Allow

    app.state.generation = Generation(service)
    app.include_router(generation_routes)
    schema.install(app)
    return app
