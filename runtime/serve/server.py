"""Serving an app on a socket taken before registration, until SIGTERM/SIGINT drains it."""

from __future__ import annotations

import socket
import threading
import time

from runtime.serve.app import Limits, create_app
from runtime.serve.openmp import release_this_threads_team
from store.errors import UserError


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, not yet listening: `dsv4 serve` takes the port before
    registration, so a port in use is one line at once, not after every phase (and clients
    are refused, not left hanging, until the service listens)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); check --host") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(infos[0][4])
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port") from None
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


def serve(launched, sock: socket.socket, limits: Limits | None = None, on_ready=None, on_stats=None,
          stats_every: float = 10.0) -> None:
    """Serve on `sock` (from `bind`) until SIGTERM/SIGINT: uvicorn stops accepting, drains
    in-flight requests, then every job is stopped and device memory released.
    `on_ready(url)` is called once the server accepts requests; `on_stats(stats)` every
    `stats_every` seconds the engine ran steps (batch size, MTP acceptance: for the events)."""
    import uvicorn

    url = url_of(sock)
    try:
        sock.listen(2048)
    except OSError as e:  # another process took the port between bind and listen
        sock.close()
        launched.close()
        raise UserError(f"cannot listen on {url} ({e.strerror}); choose another --port") from None
    app = create_app(launched, limits or Limits())
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=30))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.01)
        if server.started and on_ready:
            on_ready(url)

    threading.Thread(target=announce, daemon=True, name="serve-ready").start()
    if on_stats is not None:
        threading.Thread(target=_report_stats, args=(app.state.scheduler, server, on_stats, stats_every),
                         daemon=True, name="serve-stats").start()
    # this thread registered and runs no torch from here: its OpenMP workers go, so the engine
    # thread's are the only ones and spin between a step's kernels (runtime.serve.openmp)
    release_this_threads_team()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        app.state.scheduler.close()  # no worker touches an engine after this
        launched.close()


def _report_stats(scheduler, server, on_stats, every: float) -> None:
    last = None
    while not server.should_exit:
        time.sleep(every)
        stats = scheduler.stats
        if stats["steps"] != (last or {}).get("steps"):
            on_stats(stats)
            last = stats
