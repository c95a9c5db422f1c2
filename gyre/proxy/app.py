"""The proxy's ASGI app — the three front ends, and errors in the shape of the API a path belongs to.

Plain Starlette: FastAPI's routing, dependency and validation layers cost per call and give the proxy
nothing (each front end validates its own body with pydantic, see `http.read_model`). A model call (a
POST to one of the front ends' paths) does not pass Starlette's middleware and router either: `ProxyApp`
hands it straight to its handler and maps its errors with the same handlers (~0.1 ms of CPU less per
call); every other request (health, models, a wrong path or method) goes through the Starlette app."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gyre.proxy.anthropic_api import anthropic_routes
from gyre.proxy.core import Proxy
from gyre.proxy.errors import ApiError, ErrorKind
from gyre.proxy.http import api_of, error_response
from gyre.proxy.openai_api import openai_routes
from gyre.proxy.responses_api import responses_routes

log = logging.getLogger(__name__)

_HTTP_KINDS: dict[int, ErrorKind] = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}


Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
Handler = Callable[[Request, Exception], Awaitable[Response]]


class ProxyApp:
    """The proxy's ASGI app: POSTs to a route's exact path go straight to its endpoint, errors mapped by
    `handlers` as Starlette's exception middleware maps them (the most specific class wins; the one for
    `Exception` answers, then re-raises for the server to log, as Starlette's server-error middleware
    does); everything else goes to `app`, the Starlette app of the same routes and handlers."""

    def __init__(self, routes: list[Route], handlers: dict[type[Exception], Handler]) -> None:
        self.app = Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]
        self._posts = {route.path: route.endpoint for route in routes if "POST" in (route.methods or ())}
        self._handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._posts.get(scope["path"])
            if endpoint is not None:
                await self._serve(endpoint, scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _serve(self, endpoint: Callable[[Request], Awaitable[Response]], scope: Scope, receive: Receive,
                     send: Send) -> None:
        request = Request(scope, receive, send)
        started = False

        async def sending(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            response = await endpoint(request)
            await response(scope, receive, sending)
        except Exception as error:
            if started:  # too late for an error answer: the server logs it and drops the connection
                raise
            handler = next(self._handlers[c] for c in type(error).__mro__ if c in self._handlers)
            await (await handler(request, error))(scope, receive, send)
            if handler is self._handlers.get(Exception):  # a bug: answered, and logged by the server too
                raise


def build_app(proxy: Proxy) -> ProxyApp:
    async def health(_request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", **proxy.stats()})

    async def api_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, ApiError)
        return error_response(api_of(request.url.path), error)

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, StarletteHTTPException)
        kind = _HTTP_KINDS.get(error.status_code, "invalid_request")
        message = f"{request.method} {request.url.path}: {error.detail}"
        return error_response(api_of(request.url.path), ApiError(kind, message))

    async def gone(_request: Request, _error: Exception) -> Response:
        # The client left mid-body, or the server dropped a stalled body and answered it already (408):
        # nobody reads this answer, and it is no bug to log.
        return Response(status_code=499)

    async def unexpected(request: Request, error: Exception) -> Response:
        # A bug, not a harness mistake: logged with its traceback, answered in the API's shape (Starlette
        # re-raises it afterwards, so the server logs it too).
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        return error_response(api_of(request.url.path), ApiError("api_error", f"internal error: {error!r}"))

    routes = [
        *anthropic_routes(proxy),
        *openai_routes(proxy),
        *responses_routes(proxy),
        Route("/health", health, methods=["GET"]),
    ]
    handlers = {ApiError: api_error, StarletteHTTPException: http_error, ClientDisconnect: gone, Exception: unexpected}
    return ProxyApp(routes, handlers)  # type: ignore[arg-type]
