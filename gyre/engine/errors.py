"""Errors of the engine layer: what went wrong talking to an engine, told apart by what a caller does next
(retry elsewhere, wait, fix the request)."""

from __future__ import annotations

from gyre.errors import GyreError


class EngineError(GyreError):
    """Base class of every engine and engine-client error."""


class EngineUnreachableError(EngineError):
    """No connection could be made (refused, DNS, connect timeout) or it dropped mid-request."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"engine at {url} is unreachable: {reason}")
        self.url = url
        self.reason = reason


class EngineTimeoutError(EngineError):
    """Connected, but the engine did not answer within the timeout."""

    def __init__(self, url: str, timeout_s: float | None) -> None:
        super().__init__(f"engine at {url} did not answer within {timeout_s} s")
        self.url = url
        self.timeout_s = timeout_s


class EngineHTTPError(EngineError):
    """The engine answered with an error status; `body` is its (truncated) response text."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"engine at {url} answered HTTP {status}: {body[:2000]}")
        self.url = url
        self.status = status
        self.body = body


class EngineProtocolError(EngineError):
    """The engine answered 2xx but the body is not what SGLang's API promises, or it refused the operation
    (`{"success": false}`)."""


class EngineRequestError(EngineError, ValueError):
    """A request the engine rejects before running it; `field` names the offending field (dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class KvRefusedError(EngineError):
    """An engine refused a KV migration step (layout, page size or policy version differ; an unknown or
    stale reservation). The caller recomputes instead; `field` names what disagreed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
