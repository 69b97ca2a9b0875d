"""The connection under HTTP: uvicorn's h11 protocol with the deadlines and caps uvicorn lacks.

uvicorn bounds an idle keep-alive connection (5 s) but not one that is sending: a client
trickling one header byte a second (slow-loris), or a thousand that connect and send nothing,
held a connection — and a descriptor — each for as long as they liked. Here:

- a request's head must be complete within `head_timeout` seconds of the connection opening or
  of the previous answer; past it the connection gets `408 Request Timeout` (when part of a head
  came) and is closed;
- a client still sending a body that was already answered (a 401, a 413) is cut off the same way;
- a head is at most MAX_HEAD_BYTES: a 1 MiB header, or 10 000 small ones, is a 431 and a closed
  connection, never a buffer that grows (h11's own cap counts only a head still incomplete: one
  that arrives whole in one read, 100 KB of 10 000 headers, went through).

The body's own pace is the app's to bound (runtime.serve.http.read_body: each piece within the
same timeout). The TLS handshake before all this is asyncio's to bound (60 s).
"""

from __future__ import annotations

import functools

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEAD_BYTES = 32 << 10  # request line and headers: far past what any client sends


def _answer(status: bytes, text: bytes) -> bytes:
    """A whole answer written before any request was parsed (h11 can only answer requests)."""
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % len(text) + text)


TIMED_OUT = _answer(b"408 Request Timeout", b"the request head did not arrive in time\n")
TOO_LARGE = _answer(b"431 Request Header Fields Too Large", b"the request head is over %d bytes\n" % MAX_HEAD_BYTES)


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

    def handle_events(self) -> None:
        if self.conn.their_state is h11.IDLE:  # a head is (partly) buffered: its size first
            buffered = self.conn.trailing_data[0]
            end = buffered.find(b"\r\n\r\n")
            if (len(buffered) if end < 0 else end + 4) > MAX_HEAD_BYTES:
                self.transport.write(TOO_LARGE)
                self.transport.close()
                return
        super().handle_events()

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
