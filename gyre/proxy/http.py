"""HTTP plumbing shared by both front ends: bounded body reading, validation errors, auth, error shapes,
and running a call while watching for the harness hanging up."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse

from gyre.engine import EngineError, EngineHTTPError, EngineProtocolError
from gyre.http_server import ON_DISCONNECT, OnDisconnect, Refusal
from gyre.proxy.core import Proxy
from gyre.proxy.errors import ApiError, ErrorKind
from gyre.proxy.registry import ExecutionState
from gyre.proxy.resend import Resent, read_resent

Api = Literal["anthropic", "openai"]
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

ANTHROPIC_TYPES: dict[ErrorKind, str] = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "authentication": "authentication_error",
    "not_found": "not_found_error",
    "method_not_allowed": "invalid_request_error",
    "too_large": "request_too_large",
    "request_timeout": "timeout_error",
    "overloaded": "overloaded_error",
    "api_error": "api_error",
}
OPENAI_TYPES: dict[ErrorKind, tuple[str, str | None, int]] = {  # type, code, status
    "invalid_request": ("invalid_request_error", None, 400),
    "context_length": ("invalid_request_error", "context_length_exceeded", 400),
    "authentication": ("invalid_request_error", "invalid_api_key", 401),
    "not_found": ("invalid_request_error", "not_found", 404),
    "method_not_allowed": ("invalid_request_error", "method_not_allowed", 405),
    "too_large": ("invalid_request_error", "request_too_large", 413),
    "request_timeout": ("invalid_request_error", "request_timeout", 408),
    "overloaded": ("server_error", "engine_unavailable", 503),
    "api_error": ("server_error", None, 500),
}


class ClientGone(Exception):
    """The harness closed the connection before the answer was ready."""


def request_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def api_of(path: str) -> Api:
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def error_body(api: Api, error: ApiError, rid: str) -> tuple[int, dict[str, Any]]:
    if api == "anthropic":  # no `param` in this shape: the message names the field
        message = error.message
        if error.param and not message.startswith(error.param):
            message = f"{error.param}: {message}"
        body = {"type": "error", "error": {"type": ANTHROPIC_TYPES[error.kind], "message": message}, "request_id": rid}
        return error.status, body
    kind, code, status = OPENAI_TYPES[error.kind]
    return status, {"error": {"message": error.message, "type": kind, "param": error.param, "code": code}}


def error_parts(api: Api, error: ApiError) -> tuple[int, dict[str, Any], dict[str, str]]:
    """Status, body and headers of `error` in `api`'s shape (the app's answers and the server's refusals)."""
    rid = request_id("req_")
    status, body = error_body(api, error, rid)
    headers = {"request-id": rid} if api == "anthropic" else {"x-request-id": rid}
    if error.kind == "authentication" and api == "openai":
        headers["www-authenticate"] = "Bearer"
    return status, body, headers


class FastJSONResponse(JSONResponse):
    """A JSON body encoded by orjson (~15x Starlette's `json.dumps` on a reply; NaN is written as null)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def error_response(api: Api, error: ApiError) -> JSONResponse:
    status, body, headers = error_parts(api, error)
    return FastJSONResponse(body, status_code=status, headers=headers)


def refusal_parts(path: str | None, refusal: Refusal) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The HTTP server's refusals (bad framing, limits, timeouts) in the shape of the API `path` belongs to;
    before a request line arrived (a header timeout) the path is unknown and the OpenAI shape is used."""
    return error_parts(api_of(path or ""), ApiError(refusal.kind, refusal.message))


def from_engine(error: EngineError) -> ApiError:
    """What a harness is told when the engine fails: retryable unless the engine rejected the request."""
    if isinstance(error, EngineHTTPError) and 400 <= error.status < 500:
        return ApiError("invalid_request", f"the engine rejected the request: {error.body[:500]}")
    if isinstance(error, EngineProtocolError):
        return ApiError("api_error", f"the engine answered out of protocol: {error}")
    return ApiError("overloaded", f"the engine is unavailable: {error}")


async def read_model(request: Request, model: type[M], limit: int) -> M:
    """The body validated as `model`; every failure is a typed `ApiError` naming the field."""
    return parse_model(model, await read_body(request, limit))


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most `limit` bytes (`ApiError` beyond), not empty."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError("invalid_request", "Content-Length is not a number", "content-length")
        if int(declared) > limit:
            raise ApiError("too_large", f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError("too_large", f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError("invalid_request", "request body is empty; send a JSON object", "body")
    return raw


def parse_model(model: type[M], raw: bytes | str) -> M:
    """`raw` (JSON) validated as `model`; a failure is the `ApiError` naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from e


async def read_resent_model(request: Request, model: type[M], field: str, state: ExecutionState,
                            limit: int) -> Resent[M]:
    """The body validated as `model`, its message array `field` cut to what the execution has not sent
    before (`gyre.proxy.resend`); failures as `read_model`'s."""
    raw = await read_body(request, limit)
    return read_resent(raw, model, field, state.resent, lambda data: parse_model(model, data))


def validation_error(error: ValidationError) -> ApiError:
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return ApiError("invalid_request", f"request body is not valid JSON: {first['msg']}", "body")
    loc = [str(p) for p in first["loc"] if not _is_tag(p)]
    param = ".".join(loc) or "body"
    if first["type"] == "model_type" and not loc:
        return ApiError("invalid_request", "request body must be a JSON object", "body")
    if first["type"] == "extra_forbidden":
        return ApiError(
            "invalid_request",
            f"{param} is not supported: the proxy refuses a field it does not know rather than ignore something "
            "that may change what the model sees",
            param,
        )
    return ApiError("invalid_request", f"{param}: {first['msg']}", param)


def _is_tag(part: int | str) -> bool:
    """pydantic inserts union-member tags (`str`, `list[...]`, `function-after[...]`) into error paths."""
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "none", "list"})


def execution_of(proxy: Proxy, request: Request) -> ExecutionState:
    """The execution whose token the request carries (`Authorization: Bearer` or `x-api-key`)."""
    candidates = []
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer":
            candidates.append(value.strip())
    key = request.headers.get("x-api-key")
    if key:
        candidates.append(key.strip())
    for token in candidates:
        state = proxy.authenticate(token)
        if state is not None:
            return state
    if not candidates:
        raise ApiError("authentication", "no API key: send the execution token as a Bearer token or x-api-key")
    raise ApiError("authentication", "invalid API key: it is not the token of a registered execution")


async def until_disconnect(request: Request, work: Awaitable[T], poll_s: float,
                           on_gone: Callable[[], None] = lambda: None) -> T:
    """Await `work`, but cancel it and raise `ClientGone` if the harness hangs up first; `on_gone` runs when
    it does, before `work` is cancelled (the engine request is still in flight then: it can be aborted).

    Under `gyre.http_server` the connection's loss cancels `work` in place (`ON_DISCONNECT`): no task beside
    the request's and no wake-up every `poll_s` while the engine generates (each would find the loop idle and
    run cold); under another server, `work` runs as a task and the connection is polled every `poll_s`."""
    watch: OnDisconnect | None = request.scope.get(ON_DISCONNECT)
    if watch is None:
        return await _poll_until_disconnect(request, work, poll_s, on_gone)
    task = asyncio.current_task()
    assert task is not None
    gone = waiting = False

    def lost() -> None:
        nonlocal gone
        gone = True
        try:
            on_gone()
        finally:
            if waiting:
                task.cancel()

    unwatch = watch(lost)
    try:
        if gone:  # lost before the watch began: `work` never starts, and nothing was cancelled
            close = getattr(work, "close", None)
            if close is not None:
                close()
            raise ClientGone()
        waiting = True
        return await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:  # our own cancel alone, not the server's shutdown as well
            raise ClientGone() from None
        raise
    finally:
        unwatch()


async def _poll_until_disconnect(request: Request, work: Awaitable[T], poll_s: float,
                                 on_gone: Callable[[], None]) -> T:
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await request.is_disconnected():
                on_gone()
                task.cancel()
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
