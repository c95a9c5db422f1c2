"""`gyre.http_server.Server`: uvicorn's server without its ten wake-ups a second, stopping at once when told."""

from __future__ import annotations

import asyncio
import threading

import httpx

from gyre.http_server import Server, ServerLimits, listen, server_loop, uvicorn_config
from gyre.proxy.http import refusal_parts


async def _app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class _NeverTicks(Server):
    TICK_S = 3600.0  # a stop that waited for a tick would take an hour: the join below would time out


def _serving() -> tuple[_NeverTicks, threading.Thread, str]:
    sock = listen("127.0.0.1", 0)
    server = _NeverTicks(uvicorn_config(_app, ServerLimits(), refusal_parts, log_level="warning"))
    started = threading.Event()

    def run() -> None:
        async def main() -> None:
            task = asyncio.ensure_future(server.serve(sockets=[sock]))
            while not server.started and not task.done():
                await asyncio.sleep(0)  # yields to serve() until it listens; no wall-clock wait
            started.set()
            await task

        with asyncio.Runner(loop_factory=server_loop) as runner:
            runner.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60)
    return server, thread, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_stop_from_another_thread_ends_the_server_without_waiting_for_a_tick() -> None:
    server, thread, url = _serving()
    reply = httpx.get(url, timeout=30)
    assert reply.status_code == 200 and reply.text == "ok"
    assert reply.headers.get("date")  # the first tick set the Date header before the first request
    server.should_exit = True
    thread.join(60)
    assert not thread.is_alive(), "the server waited for its next tick (an hour away) to notice the stop"


def test_a_stop_asked_before_the_loop_runs_is_seen_at_the_first_tick() -> None:
    server = _NeverTicks(uvicorn_config(_app, ServerLimits(), refusal_parts, log_level="warning"))
    server.should_exit = True  # no loop yet: nothing to wake, the flag alone must stop it

    async def main() -> None:
        await server.main_loop()

    asyncio.run(main())
    assert server.should_exit
