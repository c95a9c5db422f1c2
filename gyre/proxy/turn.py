"""The one handler loop of the three front ends: run an opened call to its answer, plain or streamed.

Each front end parses its request, opens the call and hands `answer` a `FrontEnd`: its parser settings,
how it renders pieces and endings, and its error shape. Everything else — awaiting the engine, the hang-up
watch, the abort and engine-failure answers, durability before the last byte, releasing the call — is
here once, so the three APIs cannot drift apart.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gyre.engine import EngineError
from gyre.proxy.core import ActiveCall, Generation, Proxy
from gyre.proxy.errors import ApiError
from gyre.proxy.http import ClientGone, FastJSONResponse, from_engine, until_disconnect
from gyre.proxy.output import OutputParser, Piece
from gyre.proxy.replies import FinalText, Reply, final_text, new_parser

GENERATED_AT = "gyre-generated-at"
"""Header of a plain answer: when the engine's last token reached the proxy (Unix seconds), before the call
was made durable and rendered. A harness that paces itself by model time (the scenario agent of an emulated
run, where ``time_scale`` multiplies every millisecond of the reply's path) can count from it."""
STARTED_AT = "gyre-started-at"
"""Header of a plain answer: when the proxy opened the call (its request parsed, `model_call_started`), so that
such a harness can also leave out its request's way to the proxy (relays, a busy host)."""


class FrontEnd(Protocol):
    """What one API contributes to a call's answer (one instance per request)."""

    stop: tuple[str, ...]
    tools: bool
    id_prefix: str  # of the tool-call ids the parser mints
    keep_blank_text: bool
    headers: dict[str, str]

    def opening(self) -> list[str]:
        """Stream events before any content."""
        ...

    def deltas(self, reply: Reply, pieces: list[Piece], *, last: bool) -> list[str]:
        """Add `pieces` to `reply` (closing it when `last`) and return their stream events."""
        ...

    def settle(self, reply: Reply, pieces: list[Piece]) -> None:
        """Add a plain answer's `pieces` to `reply` and close it: `deltas` without rendering stream events
        nobody reads, where the answer needs none of them."""
        ...

    def closing(self, final: Generation, text: FinalText, reply: Reply) -> list[str]:
        """Stream events after the call is durable."""
        ...

    def failed(self, error: ApiError) -> str:
        """The stream event that reports `error` after the 200 was sent."""
        ...

    def plain(self, final: Generation, text: FinalText, reply: Reply) -> dict[str, Any]:
        """The plain (unstreamed) answer."""
        ...


def engine_aborted(final: Generation) -> ApiError | None:
    """The error a harness gets when the engine aborted its call, on every front end, plain or streamed."""
    if final.finish is not None and final.finish.type == "abort":
        return ApiError("overloaded", f"the engine aborted the call: {final.finish.message or 'no reason given'}")
    return None


async def last_generation(call: ActiveCall) -> Generation:
    final: Generation | None = None
    async for generation in call.generations():
        final = generation
    assert final is not None and final.finish is not None
    return final


def _parser(proxy: Proxy, front: FrontEnd) -> OutputParser:
    return new_parser(front.stop, front.tools, front.id_prefix, proxy.renderer.tool_call_separator)


async def answer(request: Request, proxy: Proxy, call: ActiveCall, front: FrontEnd) -> Response:
    """The call's HTTP answer: an event stream if it was opened streamed, else one JSON body once durable."""
    if call.stream:
        return StreamingResponse(
            _stream(proxy, call, front),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", **front.headers},
        )
    try:
        final = await until_disconnect(request, last_generation(call), proxy.config.disconnect_poll_s, call.abandon)
        generated_at = time.time()
        if (problem := engine_aborted(final)) is not None:
            raise problem
        assert final.finish is not None
        reply = Reply(keep_blank_text=front.keep_blank_text)
        text = final_text(proxy.codec, final.output_ids, final.finish)
        front.settle(reply, _parser(proxy, front).feed(text.text, final=True))
        await call.complete(reply.message())
    except ClientGone:
        return Response(status_code=499)
    except EngineError as e:
        raise from_engine(e) from e
    finally:
        call.abandon()
    return FastJSONResponse(front.plain(final, text, reply),
                            headers={**front.headers, STARTED_AT: f"{call.opened_at:.6f}",
                                     GENERATED_AT: f"{generated_at:.6f}"})


async def _stream(proxy: Proxy, call: ActiveCall, front: FrontEnd) -> AsyncIterator[str]:
    """Opening events, content as the engine produces it, then the closing events — sent only once the call
    is durable. An abort or engine failure after the 200 is the API's failure event."""
    parser = _parser(proxy, front)
    reply = Reply(keep_blank_text=front.keep_blank_text)
    try:
        for item in front.opening():
            yield item
        final: Generation | None = None
        try:
            async for generation in call.generations():
                if generation.finish is not None:  # the last one: the generator ends right after it
                    final = generation
                    continue
                for item in front.deltas(reply, parser.feed(proxy.codec.decode(generation.output_ids)), last=False):
                    yield item
        except EngineError as e:
            yield front.failed(from_engine(e))
            return
        assert final is not None and final.finish is not None
        if (problem := engine_aborted(final)) is not None:
            yield front.failed(problem)
            return
        text = final_text(proxy.codec, final.output_ids, final.finish)
        for item in front.deltas(reply, parser.feed(text.text, final=True), last=True):
            yield item
        await call.complete(reply.message())
        for item in front.closing(final, text, reply):
            yield item
    finally:
        call.abandon()
