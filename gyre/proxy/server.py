"""Running the proxy: in-process on a background thread (tests, the runner) or in the foreground (CLI).

`ProxyServer` owns its event loop thread; calls that touch proxy state from other threads (`redirect`)
are handed to that loop. Registering executions is safe from any thread.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvicorn

from gyre.http_server import Server, listen, server_loop, uvicorn_config
from gyre.proxy.app import build_app
from gyre.proxy.core import Proxy, harness_env
from gyre.proxy.errors import ProxyError
from gyre.proxy.http import refusal_parts
from gyre.proxy.registry import Registration

T = TypeVar("T")


def _uvicorn_config(proxy: Proxy, **kwargs: Any) -> uvicorn.Config:
    # No X-Forwarded-* rewriting (uvicorn's default, a middleware on every request): the proxy never reads
    # the client's address.
    return uvicorn_config(build_app(proxy), proxy.config.server_limits(), refusal_parts, proxy_headers=False,
                          **kwargs)


class ProxyServer:
    """`with ProxyServer(proxy) as url: ...` serves the proxy on `host` (loopback by default)."""

    def __init__(self, proxy: Proxy, host: str = "127.0.0.1", port: int = 0) -> None:
        self.proxy = proxy
        self.host = host
        self.port = port
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        sock = listen(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._server = Server(_uvicorn_config(self.proxy, log_level="warning"))
        self._thread = threading.Thread(target=self._run, args=(sock,), name="gyre-proxy-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not (self._server.started and self._loop is not None):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ProxyError(f"proxy server did not start within {timeout_s} s")
            time.sleep(0.005)
        return self.url

    def _run(self, sock: socket.socket) -> None:
        loop = server_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        assert self._server is not None
        try:
            loop.run_until_complete(self._server.serve(sockets=[sock]))
            loop.run_until_complete(self.proxy.aclose())
        finally:
            loop.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = 60.0) -> T:
        """Run `coro` on the proxy's loop from another thread and wait for its result."""
        if self._loop is None:
            raise ProxyError("the proxy server is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def register_execution(
        self, execution_id: str, token: str | None = None, *, cell_id: str | None = None, policy_version: int = 0,
        attempt: int = 0,
    ) -> Registration:
        return self.proxy.register_execution(execution_id, token, cell_id=cell_id, policy_version=policy_version,
                                             attempt=attempt)

    def harness_env(self, registration: Registration) -> dict[str, str]:
        return harness_env(registration, self.url, self.proxy.config.model_name)

    def redirect(self, from_cell: str, to_cells: list[str]) -> dict[str, str]:
        return self.call(self.proxy.redirect(from_cell, to_cells))

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(proxy: Proxy, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Serve in the foreground until interrupted (the CLI)."""

    async def main() -> None:
        server = Server(_uvicorn_config(proxy, log_level="info"))
        try:
            await server.serve(sockets=[listen(host, port)])
        finally:
            await proxy.aclose()

    with asyncio.Runner(loop_factory=server_loop) as runner:
        runner.run(main())
