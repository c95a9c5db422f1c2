"""The HTTP/1.1 server under Gyre's FastAPI apps (the proxy, the local engine): uvicorn with the limits
it lacks, and every refusal answered in the app's own JSON error shape.

uvicorn (h11) has no header or body read timeout, answers bad framing (a non-numeric Content-Length, a
garbled request line, a head over the size limit) with a plain-text 400 before the app runs, and its
connection cap answers a plain-text 503. `GuardedH11Protocol` is uvicorn's h11 protocol with:

- a header timeout: a request head (or a connection's first one) not complete within `header_timeout_s`
  is answered 408 and the connection closed (a client that opens a socket and stalls holds nothing long);
- a body timeout: a body not complete within `body_timeout_s` of its head is answered 408 and the
  connection closed; the app sees a disconnect;
- a body limit checked against Content-Length at the head and against the bytes of a chunked body;
- a connection cap: a connection beyond `max_connections` gets 503 (retryable) to its first request;
- h11's protocol errors rendered by the app's `Render` instead of plain text.

A refusal is written as raw bytes and the connection closed: h11 cannot send a response before a request
head exists (a header timeout), and the connection is finished either way.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

import h11
import uvicorn
from pydantic import BaseModel, ConfigDict, Field
from uvicorn.protocols.http.h11_impl import H11Protocol

RefusalKind = Literal["invalid_request", "too_large", "request_timeout", "overloaded"]
_STATUS: dict[RefusalKind, int] = {"invalid_request": 400, "too_large": 413, "request_timeout": 408,
                                   "overloaded": 503}
_PATH = re.compile(rb"^[A-Z]{1,16} (/[^ ?#\r\n]*)")
_HEAD_PREFIX_BYTES = 2048
REFUSAL_LINGER_S = 2.0
"""How long a refused connection is still read (and discarded) after its answer, before it is closed."""


class ServerLimits(BaseModel):
    """Limits of one HTTP server; every one is enforced before the app reads the request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_body_bytes: int = Field(64 << 20, ge=1024, description="largest request body")
    max_header_bytes: int = Field(64 << 10, ge=1024, description="largest request head (line and headers)")
    header_timeout_s: float = Field(30.0, gt=0, description="time to send a request head")
    body_timeout_s: float = Field(300.0, gt=0, description="time to send a body once its head arrived")
    max_connections: int = Field(1024, ge=1, description="open connections; more are answered 503")
    keep_alive_s: float = Field(75.0, gt=0, description="an idle keep-alive connection is closed after this")


@dataclass(frozen=True)
class Refusal:
    """Why the server answered instead of the app; `status` is the HTTP status it suggests."""

    kind: RefusalKind
    message: str

    @property
    def status(self) -> int:
        return _STATUS[self.kind]


Render = Callable[[str | None, Refusal], tuple[int, dict[str, Any], dict[str, str]]]
"""The app's error shape: (request path if known, refusal) -> (status, JSON body, extra headers)."""


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the limits of `ServerLimits`; `protocol` binds limits and shape."""

    limits: ServerLimits = ServerLimits()
    render: Render

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_prefix = bytearray()
        self._path: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._admitted = True
        self._body_bytes = 0
        self._refusal: Refusal | None = None
        self._in_head = True
        self._refused = False
        self._answered = False
        """The request being read has its answer already (the app answered before its body ended)."""
        self._receive_event = self.conn.next_event
        self.conn.next_event = self._next_event  # type: ignore[method-assign]  # observe every parsed event

    # -- the events that arm, disarm or refuse ---------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._admitted = len(self.connections) <= self.limits.max_connections
        self._arm(self.limits.header_timeout_s, "request head not received within "
                                                f"{self.limits.header_timeout_s:g}s")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused request: read only so that closing does not reset the answer
        if self._in_head:
            if self._timer is None:  # the first bytes of a keep-alive connection's next request
                self._arm(self.limits.header_timeout_s, "request head not received within "
                                                        f"{self.limits.header_timeout_s:g}s")
            if len(self._head_prefix) < _HEAD_PREFIX_BYTES:
                self._head_prefix += data[:_HEAD_PREFIX_BYTES - len(self._head_prefix)]
        super().data_received(data)

    def _next_event(self) -> Any:
        try:
            event = self._receive_event()
        except h11.RemoteProtocolError as e:
            if e.error_status_hint == 431:
                self._refusal = Refusal("too_large", f"request head exceeds {self.limits.max_header_bytes} bytes")
            else:
                self._refusal = Refusal("invalid_request", f"malformed HTTP request: {e}")
            raise
        refusal = None
        if isinstance(event, h11.Request):
            refusal = self._on_head(event)
        elif isinstance(event, h11.Data):
            self._body_bytes += len(event.data)
            if self._body_bytes > self.limits.max_body_bytes and not self._answered:  # answered: uvicorn drains it
                refusal = Refusal("too_large", f"request body exceeds the limit of {self.limits.max_body_bytes} bytes")
        elif isinstance(event, h11.EndOfMessage):
            self._disarm()
            if self._answered:  # the app answered before the body ended
                self._next_head()
        if refusal is not None:
            self._refuse(refusal)
            return h11.PAUSED  # uvicorn stops reading; the request never reaches the app (or reads no further)
        return event

    def _on_head(self, event: h11.Request) -> Refusal | None:
        """A refusal of the request from its head alone (None: admitted, body timer armed)."""
        self._disarm()
        self._in_head = self._answered = False
        self._path = event.target.partition(b"?")[0].decode("ascii", "replace")
        refusal = None
        head_bytes = len(event.method) + len(event.target) + sum(len(k) + len(v) + 4 for k, v in event.headers)
        if not self._admitted:
            refusal = Refusal("overloaded", f"the server is at its limit of {self.limits.max_connections} "
                                            "connections; retry")
        elif head_bytes > self.limits.max_header_bytes:  # h11 checks only a head that arrives in pieces
            refusal = Refusal("too_large", f"request head exceeds {self.limits.max_header_bytes} bytes")
        else:
            declared = dict((k.lower(), v) for k, v in event.headers).get(b"content-length")
            if declared is not None and int(declared) > self.limits.max_body_bytes:  # h11 checked it is digits
                refusal = Refusal("too_large", f"request body of {int(declared)} bytes exceeds the limit of "
                                               f"{self.limits.max_body_bytes} bytes")
        if refusal is None and self.conn.their_state is h11.SEND_BODY:
            self._arm(self.limits.body_timeout_s, f"request body not received within "
                                                  f"{self.limits.body_timeout_s:g}s")
        return refusal

    def on_response_complete(self) -> None:
        self._answered = True
        if self.conn.their_state is h11.DONE:  # else the app answered early, the body is still coming, and
            self._disarm()                     # the body timer still bounds how long it may take
            self._next_head()
        super().on_response_complete()


    def _next_head(self) -> None:
        self._in_head, self._path, self._body_bytes, self._answered = True, None, 0, False
        self._head_prefix.clear()

    # -- answering instead of the app ----------------------------------------------------------------

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to an h11 protocol error: in the app's shape."""
        self._refuse(self._refusal or Refusal("invalid_request", msg))

    def _refuse(self, refusal: Refusal) -> None:
        self._disarm()
        if self.transport.is_closing() or self._refused:
            return
        if self._answered:
            self.transport.close()  # its answer is sent; a body that stalls after it just loses the connection
            return
        if self.cycle is not None and not self.cycle.response_complete:
            if self.cycle.response_started:  # too late for an answer: the app's own is half sent
                self.transport.close()
                return
            self.cycle.disconnected = True  # the app's reads see a disconnect, its answer is dropped
            self.cycle.message_event.set()
        path = self._path
        if path is None and (match := _PATH.match(bytes(self._head_prefix))):
            path = match.group(1).decode("ascii", "replace")
        status, body, headers = self.render(path, refusal)
        payload = json.dumps(body).encode()
        lines = [f"HTTP/1.1 {status} {_phrase(status)}", "content-type: application/json",
                 f"content-length: {len(payload)}", "connection: close",
                 *(f"{k}: {v}" for k, v in headers.items())]
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)
        # Closing with unread input makes the kernel send RST, and a client still sending its body may then
        # lose the answer: half-close instead, discard what still comes, and close after a linger.
        self._refused = True
        self.connections.discard(self)  # a lingering refused connection does not count against the cap
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(REFUSAL_LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _arm(self, delay_s: float, message: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay_s, self._refuse, Refusal("request_timeout", message))

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:  # Anthropic's 529
        return "Overloaded" if status == 529 else "Error"


def protocol(limits: ServerLimits, render: Render) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` class bound to `limits` and to the app's error shape."""
    return type("BoundGuardedH11Protocol", (GuardedH11Protocol,),
                {"limits": limits, "render": staticmethod(render)})


def uvicorn_config(app: Any, limits: ServerLimits, render: Render, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's configuration for `app` behind the guarded protocol."""
    return uvicorn.Config(app, http=protocol(limits, render), h11_max_incomplete_event_size=limits.max_header_bytes,
                          timeout_keep_alive=limits.keep_alive_s, lifespan="off", access_log=False, backlog=4096,
                          timeout_graceful_shutdown=2, **kwargs)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket whose connections send without Nagle's delay.

    uvicorn writes a response as two segments (head, body); with Nagle on, the body waits for the client's
    delayed ACK of the head: about 40 ms per response on Linux. Accepted sockets inherit TCP_NODELAY from
    the listening socket, so it is set here once.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock
