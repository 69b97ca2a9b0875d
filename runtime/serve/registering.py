"""What `dsv4 serve` answers while it registers, on the socket it took first: 503 to everything,
`/health` with the contract's `Health` (status `registering`: rank 0's phase; of several ranks,
each host's phase and progress and the slowest host). Registration may take many minutes across
hosts; a load balancer or an operator then sees why, instead of a refused connection.

No FastAPI here: a small accept loop on the bound socket, stopped (the socket left listening)
before the service's own server takes the socket over.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler
from typing import Any

from runtime.contract import REGISTERING, Health, HostProgress, RankHealth
from runtime.events import Event
from runtime.serve.auth import OPEN_DOOR, Door, get_route_path, refusal

RETRY_AFTER_S = 5
READ_TIMEOUT_S = 10  # a client's TLS handshake, head and body, each read within this
READ_LIMIT = 1 << 20  # a request body read (and dropped) up to this much, so the answer is not reset


class Registering:
    """Rank 0's word on a launch not yet serving: a sink of its own events (its phase) and the
    listener of its hosts watch (runtime.launch.progress.HostsWatch: each host's progress)."""

    def __init__(self, spec, identity):
        self.spec, self.identity = spec, identity
        self.phase = ""  # the phase this launch is in: what its ending names too
        self._ranks: tuple[RankHealth, ...] = ()
        self._hosts: tuple[HostProgress, ...] = ()
        self._slowest = ""

    def __call__(self, event: Event) -> None:
        if event.kind == "start" and event.rank in (None, 0):
            self.phase = event.phase

    def hosts(self, ranks: list[dict[str, Any]], hosts: tuple[HostProgress, ...], slowest: str) -> None:
        self._ranks = tuple(RankHealth(slots=0, free_slots=0, running=0, **r) for r in ranks)
        self._hosts, self._slowest = hosts, slowest

    def health(self) -> Health:
        phase = self.phase or "start"
        reason = f"registering: phase {phase}"
        behind = next((h for h in self._hosts if h.host == self._slowest), None)
        if behind is not None:
            reason += f"; slowest host {behind.host}: {behind.doing}"
        spec = self.spec
        return Health(status=REGISTERING, model=str(spec.model), id=spec.model.name, slots=0, free_slots=0, queued=0,
                      running=0, max_seq=spec.max_seq, backend=spec.backend, device=spec.device,
                      host=self.identity.host, pid=self.identity.pid, started=self.identity.started,
                      programs="", ranks=self._ranks, reason=reason, phase=phase, hosts=self._hosts,
                      slowest=self._slowest)


def _shut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


def route_path(target: str, root_path: str) -> str:
    """The path the service's router will serve for a request target (as uvicorn makes the
    scope and Starlette reads it): the same door judges it here."""
    path = urllib.parse.unquote(urllib.parse.urlsplit(target).path)
    return get_route_path({"path": root_path + path, "root_path": root_path})


def answer_while_registering(sock: socket.socket, status: Registering, door: Door = OPEN_DOOR):
    """Listen on `sock` and answer every request with 503 (`/health`: `status.health()`) until
    the returned stop is called; the socket stays open and listening for the real server. The
    service's door already holds: its TLS, and its keys (401 without one)."""
    sock.listen(2048)
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            with contextlib.suppress(ValueError):
                length = int(self.headers.get("Content-Length") or 0)
                if 0 < length <= READ_LIMIT:
                    self.rfile.read(length)
            path = route_path(self.path, door.root_path)
            headers = [(k.lower().encode("latin-1"), v.encode("latin-1", "replace")) for k, v in self.headers.items()]
            name, result = door.judge(headers, path)
            if name is None:
                code, extra, raw = refusal(result)
                self.send_response(code)
                for k, v in extra:
                    self.send_header(k.decode(), v.decode())
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(raw)
                return
            value = status.health()
            if path == "/health":
                body = value.to_json()
            else:
                from runtime.serve.api import ApiError

                body = ApiError(503, f"the service is not serving yet ({value.reason}); retry later",
                                kind="server_busy", code="registering").body()
            raw = json.dumps(body).encode()
            self.send_response(503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.send_header("Retry-After", str(RETRY_AFTER_S))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _answer

        def log_message(self, *args: Any) -> None:  # the service's own log is its events
            pass

    def one(conn: socket.socket, addr) -> None:
        # each read within READ_TIMEOUT_S, and the whole exchange within twice that: a client
        # trickling a byte at a time is cut off too
        deadline = threading.Timer(2 * READ_TIMEOUT_S, lambda: _shut(conn))
        deadline.start()
        try:
            conn.settimeout(READ_TIMEOUT_S)  # the handshake too
            if door.tls is not None:
                conn = door.tls.wrap_socket(conn, server_side=True)
            Handler(conn, addr, None)
        except OSError:  # ssl.SSLError is one: a client that cannot speak TLS to us
            pass
        finally:
            deadline.cancel()
            conn.close()

    def run() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError, ValueError):
                ready, _, _ = select.select([sock], [], [], 0.1)
                if ready and not stop.is_set():
                    sock.setblocking(False)
                    try:
                        conn, addr = sock.accept()
                    except BlockingIOError:  # another's, or gone between select and accept
                        continue
                    finally:
                        sock.setblocking(True)
                    conn.setblocking(True)
                    threading.Thread(target=one, args=(conn, addr), daemon=True, name="registering-answer").start()

    thread = threading.Thread(target=run, daemon=True, name="registering")
    thread.start()

    def stopped() -> None:
        stop.set()
        thread.join()

    return stopped
