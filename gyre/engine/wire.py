"""A minimal keep-alive HTTP/1.1 client for the hot paths to an engine: the proxy's `/generate` (without
streaming) and the KV mover's `/gyre/kv/*` calls.

httpx costs about 0.9 ms of CPU per request on this class of machine; this costs about 0.1 ms, and the proxy
makes one such request per model call on its only event loop (a KV migration makes two on a redirect's
critical path). It does only what an SGLang engine needs:
POST with a JSON body, `Content-Length` or chunked responses, pooled connections. Streams and TLS go through
httpx.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from gyre.engine.errors import EngineTimeoutError, EngineUnreachableError


class WireError(ConnectionError):
    """The connection failed or the response was not HTTP/1.1 as expected."""


@dataclass(frozen=True, slots=True)
class WireResponse:
    status: int
    body: bytes


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class WirePool:
    """Kept-alive connections to one `http://host:port[/prefix]` (a prefix goes before every posted path, as
    httpx's `base_url` does)."""

    def __init__(self, base_url: str, max_idle: int = 1024) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"WirePool speaks plain http only, got {base_url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._host_header = f"{self.host}:{self.port}".encode()
        self._idle: list[Conn] = []
        self._max_idle = max_idle

    async def _connect(self) -> Conn:
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return reader, writer

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> WireResponse:
        """POST `body`; a kept-alive connection the server closed meanwhile is retried once on a new one.
        Idle connections whose close has already arrived are dropped unused, so the resend - which could
        repeat a request the server handled before dropping the connection - happens at most once."""
        head = b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            (self.prefix + path).encode(),
            self._host_header,
            len(body),
            b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items()),
        )
        while self._idle:
            conn = self._idle.pop()
            if conn[0].at_eof() or conn[1].is_closing():  # the server's close already arrived: never sent on
                conn[1].close()
                continue
            try:
                return await self._exchange(conn, head + body)
            except _StaleConnection:
                break  # sent, and nothing came back: one resend on a new connection, not on every idle one
        try:
            return await self._exchange(await self._connect(), head + body)
        except _StaleConnection as e:
            raise WireError(f"{self.host}:{self.port} closed the connection without answering") from e

    async def _exchange(self, conn: Conn, request: bytes) -> WireResponse:
        reader, writer = conn
        done = False
        try:
            writer.write(request)
            try:
                status_line = await reader.readline()
            except (ConnectionError, OSError) as e:
                raise _StaleConnection() from e
            if not status_line:
                raise _StaleConnection()
            response = await _read_response(reader, status_line)
            done = True
        except _StaleConnection:
            writer.close()
            raise
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ValueError) as e:
            raise WireError(f"{self.host}:{self.port}: {type(e).__name__}: {e}") from e
        finally:
            if not done:
                writer.close()
        keep, response = response
        if keep and len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            writer.close()
        return response

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def post_or_raise(pool: WirePool, path: str, body: bytes, headers: dict[str, str], timeout_s: float | None,
                        url: str) -> WireResponse:
    """`pool.post` with its failures as the engine errors httpx's would become: no answer within `timeout_s`
    is `EngineTimeoutError`, a failed or dropped connection `EngineUnreachableError` (`url` names the engine)."""
    try:
        async with asyncio.timeout(timeout_s):  # in this task (wait_for would start a second one per call)
            return await pool.post(path, body, headers)
    except TimeoutError as e:
        raise EngineTimeoutError(url, timeout_s) from e
    except (WireError, OSError) as e:
        raise EngineUnreachableError(url, str(e) or type(e).__name__) from e


class _StaleConnection(Exception):
    """Nothing came back on a reused connection: the server had closed it; safe to resend."""


async def _read_response(reader: asyncio.StreamReader, status_line: bytes) -> tuple[bool, WireResponse]:
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    status = int(parts[1])
    length: int | None = None
    chunked = False
    keep = parts[0] == b"HTTP/1.1"
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
        elif name == b"connection":
            keep = value.lower() == b"keep-alive" or (keep and value.lower() != b"close")
    if chunked:
        pieces = []
        while True:
            size = int((await reader.readline()).split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                break
            pieces.append(await reader.readexactly(size))
            await reader.readexactly(2)
        return keep, WireResponse(status, b"".join(pieces))
    if length is None:
        return False, WireResponse(status, await reader.read())
    return keep, WireResponse(status, await reader.readexactly(length))
