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
from http.server import BaseHTTPRequestHandler
from typing import Any

from runtime.events import Event
from runtime.serve.contract import REGISTERING, Health, HostProgress, RankHealth

RETRY_AFTER_S = 5
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


def answer_while_registering(sock: socket.socket, status: Registering):
    """Listen on `sock` and answer every request with 503 (`/health`: `status.health()`) until
    the returned stop is called; the socket stays open and listening for the real server."""
    sock.listen(2048)
    stop = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            with contextlib.suppress(ValueError):
                length = int(self.headers.get("Content-Length") or 0)
                if 0 < length <= READ_LIMIT:
                    self.rfile.read(length)
            value = status.health()
            if self.path.split("?")[0] == "/health":
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
        with contextlib.suppress(OSError), conn:
            conn.settimeout(10)
            Handler(conn, addr, None)

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
