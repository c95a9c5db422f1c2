"""Errors of the proxy. `ApiError` is what a harness is told; each API renders it in its own shape."""

from __future__ import annotations

from typing import Literal

from gyre.engine.errors import EngineUnreachableError
from gyre.errors import GyreError

ErrorKind = Literal[
    "invalid_request",
    "context_length", "authentication", "not_found", "method_not_allowed", "too_large", "request_timeout",
    "overloaded", "api_error"
]

STATUS: dict[ErrorKind, int] = {
    "invalid_request": 400,
    "context_length": 400,
    "authentication": 401,
    "not_found": 404,
    "method_not_allowed": 405,
    "too_large": 413,
    "request_timeout": 408,
    "overloaded": 529,
    "api_error": 500,
}


class ProxyError(GyreError):
    """Base class of proxy errors."""


class ApiError(ProxyError):
    """An error answered to the harness. `param` names the request field at fault (dotted path)."""

    def __init__(self, kind: ErrorKind, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param

    @property
    def status(self) -> int:
        return STATUS[self.kind]


class UnknownExecutionError(ProxyError, KeyError):
    """No execution is registered under that id."""


class UnknownCellError(ProxyError, KeyError):
    """No engine is configured for that cell."""


class EngineLostError(ProxyError, EngineUnreachableError):
    """A call's engine was lost and no other cell admitted its execution within `engine_lost_wait_s`. The
    front ends answer it as any unreachable engine: overloaded (Anthropic 529 `overloaded_error`, OpenAI 503
    `server_error`), which SDKs retry."""

    def __init__(self, url: str, reason: str) -> None:
        EngineUnreachableError.__init__(self, url, reason)
