"""The proxy's ASGI app — the three front ends, and errors in the shape of the API a path belongs to.

Plain Starlette: FastAPI's routing, dependency and validation layers cost per call and give the proxy
nothing (each front end validates its own body with pydantic, see `http.read_model`)."""

from __future__ import annotations

import logging

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


def build_app(proxy: Proxy) -> Starlette:
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
    return Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]
