"""The HTTP/1.1 server under Gyre's FastAPI apps (the proxy, the local engine): uvicorn with the limits
it lacks, and every refusal answered in the app's own JSON error shape.

uvicorn has no header or body read timeout, answers bad framing (a non-numeric Content-Length, a garbled
request line) with a plain-text 400 before the app runs, its httptools front has no limit on a request
head at all, and its connection cap answers a plain-text 503. `GuardedHttpToolsProtocol` is uvicorn's
httptools protocol (llhttp, C: about half the server CPU of its pure-Python h11 front per call) with:

- a header timeout: a request head (or a connection's first one) not complete within `header_timeout_s`
  is answered 408 and the connection closed (a client that opens a socket and stalls holds nothing long);
- a body timeout: a body not complete within `body_timeout_s` of its head is answered 408 and the
  connection closed; the app sees a disconnect;
- a head limit (the parser buffers a header until it is whole) and a body limit checked against
  Content-Length at the head and against the bytes of a chunked body;
- a connection cap: a connection beyond `max_connections` gets 503 (retryable) to its first request;
- llhttp's framing errors rendered by the app's `Render` instead of plain text.

A refusal is written as raw bytes and the connection closed: there may be no request head to answer (a
header timeout), and the connection is finished either way. Timers are armed only for a head or body that
a read leaves incomplete, so a request that arrives whole costs none.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

import httptools
import uvicorn
import uvloop
from pydantic import BaseModel, ConfigDict, Field
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

RefusalKind = Literal["invalid_request", "too_large", "request_timeout", "overloaded"]
_STATUS: dict[RefusalKind, int] = {"invalid_request": 400, "too_large": 413, "request_timeout": 408,
                                   "overloaded": 503}
REFUSAL_LINGER_S = 2.0
"""How long a refused connection is still read (and discarded) after its answer, before it is closed."""
ON_DISCONNECT = "gyre.on_disconnect"
"""Scope key of a request this server serves: `OnDisconnect`, so that an app can watch for the client hanging
up without polling (Starlette's `Request.is_disconnected` costs a wake-up and a task per poll)."""

OnDisconnect = Callable[[Callable[[], None]], Callable[[], None]]
"""Calls its argument once when the request's connection is lost (at once if it is already); returns the
function that unregisters it."""


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


def _nothing() -> None:
    pass


class _Stop(Exception):
    """Raised from a parser callback once the request is refused: llhttp stops reading there."""


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of `ServerLimits`; `protocol` binds limits and shape."""

    limits: ServerLimits = ServerLimits()
    render: Render

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.url = b""  # uvicorn sets it at a request's first byte; a refusal may come before any
        self._timer: asyncio.TimerHandle | None = None
        self._admitted = True
        self._state: Literal["idle", "head", "body"] = "idle"
        """Where the parser is: between requests, inside a request head, inside a body."""
        self._head_bytes = 0
        """Bytes of the reads since the last request ended, while its body was not being read: never more
        than the head's own (a read that reaches the body stops the count), at most one read fewer."""
        self._body_bytes = 0
        self._refused = False
        self._lost = False
        self._on_lost: list[Callable[[], None]] = []

    # -- the events that arm, disarm or refuse ---------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._admitted = len(self.connections) <= self.limits.max_connections
        self._arm_head()  # a connection that never says a word

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
        self._lost = True
        watchers, self._on_lost = self._on_lost, []
        for watcher in watchers:
            watcher()

    def _on_disconnect(self, watcher: Callable[[], None]) -> Callable[[], None]:
        """`OnDisconnect` of this connection's requests."""
        if self._lost:
            watcher()
            return _nothing
        self._on_lost.append(watcher)

        def unwatch() -> None:
            with contextlib.suppress(ValueError):  # it was called already: the connection is gone
                self._on_lost.remove(watcher)

        return unwatch

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # the rest of a refused request: read only so that closing does not reset the answer
        self._unset_keepalive_if_required()
        if self._state != "body":
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            if not self._refused:
                self._refuse(Refusal("invalid_request", f"malformed HTTP request: {e}"))
            return
        except httptools.HttpParserUpgrade:  # as uvicorn's own protocol
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if self._state == "head" and self._head_bytes > self.limits.max_header_bytes:
            self._refuse(Refusal("too_large", f"request head exceeds {self.limits.max_header_bytes} bytes"))
        elif self._timer is None and self._state != "idle":  # this read left a head or a body incomplete
            if self._state == "head":
                self._arm_head()
            else:
                self._arm(self.limits.body_timeout_s, f"request body not received within "
                                                      f"{self.limits.body_timeout_s:g}s")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[ON_DISCONNECT] = self._on_disconnect  # type: ignore[literal-required]
        self._state, self._body_bytes = "head", 0

    def on_headers_complete(self) -> None:
        self._disarm()
        refusal = None
        head_bytes = len(self.url)
        declared = None
        for name, value in self.headers:
            head_bytes += len(name) + len(value) + 4
            if name == b"content-length":
                declared = value  # llhttp checked it is digits, and the only one
        if not self._admitted:
            refusal = Refusal("overloaded", f"the server is at its limit of {self.limits.max_connections} "
                                            "connections; retry")
        elif head_bytes > self.limits.max_header_bytes:
            refusal = Refusal("too_large", f"request head exceeds {self.limits.max_header_bytes} bytes")
        elif declared is not None and int(declared) > self.limits.max_body_bytes:
            refusal = Refusal("too_large", f"request body of {int(declared)} bytes exceeds the limit of "
                                           f"{self.limits.max_body_bytes} bytes")
        if refusal is not None:
            self._stop(refusal)  # the request never reaches the app
        self._state = "body"
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self.limits.max_body_bytes and not self.cycle.response_complete:
            self._stop(Refusal("too_large", f"request body exceeds the limit of {self.limits.max_body_bytes} bytes"))
        super().on_body(body)  # answered already: uvicorn discards the rest

    def on_message_complete(self) -> None:
        self._disarm()
        self._state, self._head_bytes = "idle", 0
        super().on_message_complete()

    # -- answering instead of the app ----------------------------------------------------------------

    def _stop(self, refusal: Refusal) -> None:
        self._refuse(refusal)
        raise _Stop  # out of the parser callback: llhttp reads no further

    def _refuse(self, refusal: Refusal) -> None:
        self._disarm()
        if self.transport.is_closing() or self._refused:
            return
        cycle = self.cycle
        if self._state == "body" and cycle is not None and cycle.response_complete:
            self.transport.close()  # its answer is sent; a body that stalls after it just loses the connection
            return
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started:  # too late for an answer: the app's own is half sent
                self.transport.close()
                return
            cycle.disconnected = True  # the app's reads see a disconnect, its answer is dropped
            cycle.message_event.set()
        path = self.url.partition(b"?")[0].decode("ascii", "replace") or None
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

    def _arm_head(self) -> None:
        self._arm(self.limits.header_timeout_s, f"request head not received within {self.limits.header_timeout_s:g}s")

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


def protocol(limits: ServerLimits, render: Render) -> type[GuardedHttpToolsProtocol]:
    """A `GuardedHttpToolsProtocol` class bound to `limits` and to the app's error shape."""
    return type("BoundGuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,),
                {"limits": limits, "render": staticmethod(render)})


class Server(uvicorn.Server):
    """uvicorn's server, waking once a second (to refresh its `Date` header) instead of ten times, and at once
    when told to exit (`should_exit = True`, from any thread or a signal handler).

    uvicorn's main loop sleeps 0.1 s between looks at `should_exit`: ten wake-ups a second of a process that
    may be serving nothing, each paid cold on a virtualised core (an idle proxy spent ~1.5 ms of CPU a second
    on them, a proxy at 32 calls/s ~0.05 ms a call). Exit is an event instead of a poll, so stopping stays
    immediate."""

    TICK_S = 1.0

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit_flag = False
        self._wake: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        super().__init__(config)

    @property
    def should_exit(self) -> bool:  # type: ignore[override]
        return self._exit_flag

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit_flag = value
        if value and self._wake is not None:
            loop, event = self._wake
            with contextlib.suppress(RuntimeError):  # a closed loop: nothing is left to wake
                loop.call_soon_threadsafe(event.set)

    async def main_loop(self) -> None:
        event = asyncio.Event()
        self._wake = (asyncio.get_running_loop(), event)
        counter = 0  # uvicorn's `on_tick` refreshes the Date header when counter % 10 == 0: every tick here
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864_000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), self.TICK_S)


def uvicorn_config(app: Any, limits: ServerLimits, render: Render, **kwargs: Any) -> uvicorn.Config:
    """uvicorn's configuration for `app` behind the guarded protocol."""
    return uvicorn.Config(app, http=protocol(limits, render), timeout_keep_alive=limits.keep_alive_s, lifespan="off",
                          access_log=False, backlog=4096, timeout_graceful_shutdown=2, **kwargs)


def server_loop() -> asyncio.AbstractEventLoop:
    """A new event loop for a server: uvloop's (libuv), whose scheduling, timers and socket transports cost
    the proxy about 4% (7% with its log's thread hand-offs) less CPU per call than asyncio's own."""
    return uvloop.new_event_loop()


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
