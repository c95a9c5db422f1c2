"""`gyre.engine.wire.WirePool` (the proxy's and the KV mover's HTTP client): a request the server handled
before dropping the connection is sent again at most once, and an idle connection the server closed is
never used."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from gyre.engine.wire import WireError, WirePool


class _Server:
    """Counts the requests it reads; answers them with keep-alive, or (`drop`) handles them and closes."""

    def __init__(self) -> None:
        self.handled = 0
        self.paths: list[str] = []
        self.drop = False
        self.close_after_answer = False
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.paths.append(head.split(b" ")[1].decode())
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length"))
                body = await reader.readexactly(length)
                self.handled += 1
                if self.drop:
                    break
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
                if self.close_after_answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()


def _with_pool(test: Callable[[_Server, WirePool], Awaitable[None]], *, close_after_answer: bool = False,
               suffix: str = "") -> None:
    """Run `test` against a fresh server and a pool of connections to it (`suffix` is added to its URL)."""

    async def run() -> None:
        server = _Server()
        server.close_after_answer = close_after_answer
        pool = WirePool(await server.start() + suffix)
        try:
            await test(server, pool)
        finally:
            pool.close()
            await server.stop()

    asyncio.run(run())


def test_a_request_dropped_after_handling_is_sent_again_at_most_once() -> None:
    async def test(server: _Server, pool: WirePool) -> None:
        answers = await asyncio.gather(*(pool.post("/x", b"%d" % i, {}) for i in range(3)))
        assert [a.body for a in answers] == [b"0", b"1", b"2"] and server.handled == 3  # three idle now
        server.drop = True
        with pytest.raises(WireError, match="closed the connection without answering"):
            await pool.post("/x", b"once", {})
        assert server.handled == 3 + 2  # on an idle connection, then one resend on a new one; not 3 + 4

    _with_pool(test)


def test_an_idle_connection_the_server_closed_is_not_used() -> None:
    async def test(server: _Server, pool: WirePool) -> None:
        assert (await pool.post("/x", b"a", {})).body == b"a"
        assert (await pool.post("/x", b"b", {})).body == b"b"  # the first connection is closed by now
        assert server.handled == 2  # each request delivered once

    _with_pool(test, close_after_answer=True)


def test_a_base_url_path_prefixes_every_request() -> None:
    async def test(server: _Server, pool: WirePool) -> None:
        assert (await pool.post("/gyre/kv/offer", b"x", {})).body == b"x"
        assert server.paths == ["/engine/gyre/kv/offer"]

    _with_pool(test, suffix="/engine/")
