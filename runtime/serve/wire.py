"""The connection under HTTP: uvicorn's h11 protocol with the deadlines and caps uvicorn lacks.

uvicorn bounds an idle keep-alive connection (5 s) but not one that is sending: a client
trickling one header byte a second (slow-loris), or a thousand that connect and send nothing,
held a connection — and a descriptor — each for as long as they liked. Here:

- a request's head must be complete within `head_timeout` seconds of the connection opening or
  of the previous answer; past it the connection gets `408 Request Timeout` (when part of a head
  came) and is closed;
- a client still sending a body that was already answered (a 401, a 413) is cut off the same way;
- a head is at most MAX_HEAD_BYTES (h11's incomplete-event cap): a 1 MiB header, or 10 000 small
  ones, is a 400 and a closed connection, never a buffer that grows.

The body's own pace is the app's to bound (runtime.serve.http.read_body: each piece within the
same timeout). The TLS handshake before all this is asyncio's to bound (60 s).
"""

from __future__ import annotations

import functools

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEAD_BYTES = 32 << 10  # request line and headers: far past what any client sends
TIMED_OUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 34\r\n" \
            b"connection: close\r\n\r\nthe request head did not arrive.\r\n"


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on what the client owes: a head, or the rest of
    a body nobody reads any more."""

    def __init__(self, *args, head_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout
        self._deadline = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._watch()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _owing(self) -> bool:
        """The client owes a head (between requests), or a body that was answered already."""
        waiting_head = self.conn.their_state is h11.IDLE
        answered = self.conn.our_state in (h11.DONE, h11.MUST_CLOSE) and self.conn.their_state is h11.SEND_BODY
        return waiting_head or answered

    def _watch(self) -> None:
        if self._owing():
            if self._deadline is None and not self.transport.is_closing():
                self._deadline = self.loop.call_later(self.head_timeout, self._late)
        else:
            self._disarm()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or not self._owing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a head came
            self.transport.write(TIMED_OUT)
        self.transport.close()


def protocol(head_timeout: float):
    """The `http` protocol class for uvicorn.Config (its constructor with the deadline bound)."""
    return functools.partial(GuardedH11, head_timeout=head_timeout)
