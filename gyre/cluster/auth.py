"""The run secret on every gRPC call: minted once per run, checked by an interceptor before any handler.

The controller mints the secret (`gyre.auth.mint(RUN_PREFIX)`) and hands it to the processes it starts through
the environment (`GYRE_RUN_SECRET`) or a 0600 file, never argv. Clients send it as `authorization: Bearer
<secret>` metadata; servers keep only its digest and compare in constant time. A call without it, or with
another run's, ends with UNAUTHENTICATED before its handler runs — streams included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from gyre import auth

SECRET_ENV = "GYRE_RUN_SECRET"
_HEADER = "authorization"
_SCHEME = "Bearer "


def metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``secret``."""
    return ((_HEADER, _SCHEME + auth.check(secret, "run secret")),)


def secret_from_env() -> str:
    return auth.from_env(SECRET_ENV, "run secret")


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata does not carry the run's secret."""

    def __init__(self, secret: str) -> None:
        self._digest = auth.digest(auth.check(secret, "run secret"))
        self._denials = _denials("missing or wrong run secret")

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        presented = dict(details.invocation_metadata or ()).get(_HEADER, "")
        if presented.startswith(_SCHEME) and auth.verify(presented[len(_SCHEME):], self._digest):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        kind = ("stream_" if handler.request_streaming else "unary_") + (
            "stream" if handler.response_streaming else "unary")
        return self._denials[kind]


def _denials(message: str) -> dict[str, grpc.RpcMethodHandler]:
    """A handler of each call shape that ends the call with UNAUTHENTICATED."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover (abort raises)

    return {"unary_unary": grpc.unary_unary_rpc_method_handler(unary),
            "stream_unary": grpc.stream_unary_rpc_method_handler(unary),
            "unary_stream": grpc.unary_stream_rpc_method_handler(streaming),
            "stream_stream": grpc.stream_stream_rpc_method_handler(streaming)}
