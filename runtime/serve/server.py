"""Serving an app on a socket taken before registration, until SIGTERM/SIGINT drains it: its
door (keys, TLS: runtime.serve.auth.Door) in front, uvicorn's h11 protocol with deadlines under
it (runtime.serve.wire)."""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time

from runtime.log import SUMMARY_EVERY_S, log_summary
from runtime.serve.app import Limits, create_app
from runtime.serve.auth import OPEN_DOOR, Door
from runtime.serve.openmp import release_this_threads_team
from runtime.serve.wire import MAX_HEAD_BYTES, protocol
from store.errors import UserError

OPEN_FILES = 65536  # the soft descriptor limit is raised to this (within the hard one): every
# connection is a descriptor, and a thousand idle ones must not starve the service's own files


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


def url_of(sock: socket.socket, tls: bool = False, name: str = "") -> str:
    """The service's URL: https when it speaks TLS, there naming `name` (the --host a
    certificate is for) unless it is a wildcard address."""
    host, port = sock.getsockname()[:2]
    scheme = "https" if tls else "http"
    if tls and name and name not in ("0.0.0.0", "::", ""):
        host = name
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def raise_open_files(want: int = OPEN_FILES) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def server_config(app, limits: Limits, door: Door):
    """uvicorn's settings for the service (the tests' in-process servers use the same)."""
    import uvicorn

    tls = door.tls
    # uvicorn's own lines go through the service's log (runtime.log: its warnings only); its
    # access lines are replaced by ours (runtime.serve.http.AccessLog), which say more
    return uvicorn.Config(app, log_level="warning", log_config=None, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=30,
                          http=protocol(limits.read_timeout), h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                          root_path=door.root_path,
                          ssl_context_factory=(lambda _config, _default: tls) if tls is not None else None)


def serve(launched, sock: socket.socket, limits: Limits | None = None, on_ready=None, on_stats=None,
          stats_every: float = SUMMARY_EVERY_S, door: Door = OPEN_DOOR, url: str | None = None, on_fatal=None) -> None:
    """Serve on `sock` (from `bind`) until SIGTERM/SIGINT: uvicorn stops accepting, drains
    in-flight requests, then every job is stopped and device memory released. `door`: the
    keys and TLS; `url`: what to announce (default from the socket); `on_fatal(reason)`: the
    engine thread died (runtime.serve.app.create_app).
    `on_ready(url)` is called once the server accepts requests; every `stats_every` seconds
    while there is work, a summary line (runtime.log.log_summary) and `on_stats(stats)`
    (batch size, MTP acceptance: for the events)."""
    import uvicorn

    url = url or url_of(sock, door.tls is not None)
    limits = limits or Limits()
    try:
        sock.listen(2048)
    except OSError as e:  # another process took the port between bind and listen
        sock.close()
        launched.close()
        raise UserError(f"cannot listen on {url} ({e.strerror}); choose another --port") from None
    raise_open_files()
    app = create_app(launched, limits, door=door, on_fatal=on_fatal)
    server = uvicorn.Server(server_config(app, limits, door))

    def announce() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.01)
        if server.started and on_ready:
            on_ready(url)

    threading.Thread(target=announce, daemon=True, name="serve-ready").start()
    threading.Thread(target=_report_stats, args=(app.state.scheduler, app.state.service.metrics, server, on_stats,
                                                 stats_every), daemon=True, name="serve-stats").start()
    # this thread registered and runs no torch from here: its OpenMP workers go, so the engine
    # thread's are the only ones and spin between a step's kernels (runtime.serve.openmp)
    release_this_threads_team()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        app.state.scheduler.close()  # no worker touches an engine after this
        launched.close()


def _report_stats(scheduler, metrics, server, on_stats, every: float) -> None:
    """At each multiple of `every` whole seconds (at least 1) of the recent tally's clock where
    there was work (a request answered, a token made, one running or waiting): the summary line of
    the whole seconds since the last one (`Tally.seconds`: a sliding window read at uneven times
    lost what fell between two reads, a first token among it); the engine's stats to `on_stats`
    when it ran steps."""
    tally, every = metrics.recent, max(1, round(every))
    last, end = None, (int(tally.clock()) // every + 1) * every
    while not server.should_exit:
        wait = end - tally.clock()
        if wait > 0:
            time.sleep(wait + 1e-3)  # just past the boundary: what is counted after it is the next line's
            continue
        recent, stats = tally.seconds(end - every, end), scheduler.stats
        end += every
        if recent.requests_s or recent.generation_tokens_s or scheduler.running or scheduler.queued:
            log_summary(recent, scheduler.running, scheduler.queued, scheduler.slots, scheduler.free_slots,
                        stats.get("acceptance"))
        if on_stats is not None and stats["steps"] != (last or {}).get("steps"):
            on_stats(stats)
            last = stats
