"""The proxy's FastAPI app: the three front ends, and errors in the shape of the API a path belongs to."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from gyre.proxy.anthropic_api import anthropic_router
from gyre.proxy.core import Proxy
from gyre.proxy.errors import ApiError, ErrorKind
from gyre.proxy.http import api_of, error_response
from gyre.proxy.openai_api import openai_router
from gyre.proxy.responses_api import responses_router

log = logging.getLogger(__name__)

_HTTP_KINDS: dict[int, ErrorKind] = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}


def build_app(proxy: Proxy) -> FastAPI:
    app = FastAPI(title="gyre proxy", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(anthropic_router(proxy))
    app.include_router(openai_router(proxy))
    app.include_router(responses_router(proxy))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", **proxy.stats()})

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return error_response(api_of(request.url.path), error)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = _HTTP_KINDS.get(error.status_code, "invalid_request")
        message = f"{request.method} {request.url.path}: {error.detail}"
        return error_response(api_of(request.url.path), ApiError(kind, message))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_request: Request, _error: ClientDisconnect) -> Response:
        # The client left mid-body, or the server dropped a stalled body and answered it already (408):
        # nobody reads this answer, and it is no bug to log.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        # A bug, not a harness mistake: logged with its traceback, answered in the API's shape (Starlette
        # re-raises it afterwards, so the server logs it too).
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        return error_response(api_of(request.url.path), ApiError("api_error", f"internal error: {error!r}"))

    return app
