"""HTTP plumbing under the routes: safe JSON, status counting and access lines, capped bodies,
disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette._utils import get_route_path

from runtime.log import Access, access_line
from runtime.serve.api import ApiError

CLIENT_GONE = 499  # nginx's "client closed request": counted, never seen by the client
ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/models/{model}", "/v1/completions",
             "/v1/chat/completions")


class ClientGone(Exception):
    """The client disconnected before its answer: the job is cancelled, the status is 499."""


class SafeJSONResponse(JSONResponse):
    """ASCII-escaped JSON: a message quoting client text (a lone surrogate included) always
    encodes, and NaN never leaves as invalid JSON."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error_response(e: ApiError) -> SafeJSONResponse:
    return SafeJSONResponse(e.body(), status_code=e.status, headers=e.headers)


REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class AccessLog:
    """ASGI middleware, outermost: every response counted by endpoint and status (500s of our
    bugs too) and said in one access line (runtime.log.access_line) once its last byte is
    sent. The request's `Access` (scope state `access`) is what the routes fill in; its id is the
    client's X-Request-Id when it sent a sane one, and goes back in the answer's header."""

    def __init__(self, app, count: Callable[[str, int], None]):
        self.app, self.count = app, count

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
        given = bool(REQUEST_ID.fullmatch(sent))
        access = Access(sent if given else f"req-{uuid.uuid4().hex[:16]}", time.perf_counter(), sent=given)
        scope.setdefault("state", {})["access"] = access
        status: list[int] = []

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", access.id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            code = status[0] if status else 500
            self.count(endpoint_of(scope), code)
            client = scope.get("client")
            access_line(access, f"{client[0]}:{client[1]}" if client else "-", scope.get("method", ""),
                        scope.get("path", ""), code, scope["state"].get("api_key") or None,
                        time.perf_counter() - access.started)


def access_of(request: Request) -> Access:
    """The request's access record (a request served outside the middleware gets a fresh one)."""
    found = request.scope.setdefault("state", {}).get("access")
    if found is None:
        found = request.scope["state"]["access"] = Access(f"req-{uuid.uuid4().hex[:16]}", time.perf_counter())
    return found


def endpoint_of(scope: dict) -> str:
    """The route template of a request (a bounded set of label values), or "other". A request
    answered before routing (a 401) is named by its route path when that is a fixed endpoint."""
    path = getattr(scope.get("route"), "path", None)
    if path is None and "path" in scope:
        path = get_route_path(scope)
    return path if path in ENDPOINTS else "other"


def _too_large(message: str) -> ApiError:
    # closing the connection stops the rest of the body at the socket: kept open, it would be
    # read (and thrown away) to the last byte
    return ApiError(413, message, code="request_too_large", headers={"Connection": "close"})


# A 413 answered while the body still arrives is followed by a close with bytes unread, which
# the kernel answers with a reset; a client still sending then reads ECONNRESET, not the 413
# (a 900 KB body against the 64 KiB cap did, most times). Up to this many bytes past the cap
# the rest is read and dropped first, so the answer arrives; beyond, closing at once is
# cheaper than reading, and such a client may see the reset.
DRAIN_PAST_CAP = 4 << 20


async def _pieces(request: Request, timeout: float) -> AsyncIterator[bytes]:
    """The body's pieces as they arrive, each within `timeout` seconds (else a 408 that closes
    the connection); a client gone mid-body is ClientGone (499), not a traceback."""
    while True:
        try:
            message = await asyncio.wait_for(request.receive(), timeout)
        except TimeoutError:
            raise ApiError(408, f"body: nothing arrived for {timeout:g} s; send the body at once",
                           code="request_timeout", headers={"Connection": "close"}) from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


async def _drain(chunks: AsyncIterator[bytes], limit: int) -> None:
    """Read and drop the rest of a body, up to `limit` more bytes."""
    with contextlib.suppress(ApiError, ClientGone):  # the 413 is the answer either way
        async for chunk in chunks:
            limit -= len(chunk)
            if limit < 0:
                return


async def read_body(request: Request, cap: int, timeout: float) -> bytes:
    """The request body, refused (413) past `cap` bytes: by Content-Length before it is kept,
    or as soon as a chunked body grows past it. A body up to DRAIN_PAST_CAP over is read to
    its end (and dropped) before the answer, so the client gets it. Each piece must arrive
    within `timeout` seconds (408)."""
    pieces = _pieces(request, timeout)
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(400, "content-length: not an integer") from None
        if size > cap:
            if size <= cap + DRAIN_PAST_CAP:
                await _drain(pieces, size)
            raise _too_large(f"body: {size} bytes is over this server's limit of {cap} bytes")
    chunks, total = [], 0
    async for chunk in pieces:
        total += len(chunk)
        if total > cap:
            await _drain(pieces, cap + DRAIN_PAST_CAP - total)
            raise _too_large(f"body: over this server's limit of {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body is read by now, so the next ASGI message
    uvicorn delivers is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
