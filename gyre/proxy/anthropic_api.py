"""`POST /v1/messages` (plain and streamed) and `POST /v1/messages/count_tokens`, Anthropic-shaped."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gyre.engine import EngineError
from gyre.proxy.anthropic_models import CountTokensRequest, MessagesRequest
from gyre.proxy.core import ActiveCall, CallSettings, Generation, Proxy
from gyre.proxy.errors import ApiError
from gyre.proxy.http import (
    ANTHROPIC_TYPES,
    ClientGone,
    execution_of,
    from_engine,
    read_model,
    request_id,
    until_disconnect,
)
from gyre.proxy.replies import FinalText, Reply, final_text, new_parser


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def stop_reason(final: Generation, text: FinalText, reply: Reply) -> str:
    assert final.finish is not None
    if final.finish.type == "length":
        return "max_tokens"
    if text.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if reply.calls else "end_turn"


async def last_generation(call: ActiveCall) -> Generation:
    final: Generation | None = None
    async for generation in call.generations():
        final = generation
    assert final is not None and final.finish is not None
    return final


def engine_aborted(final: Generation) -> ApiError | None:
    """The error a harness gets when the engine aborted its call (every front end answers it the same way)."""
    if final.finish is not None and final.finish.type == "abort":
        return ApiError("overloaded", f"the engine aborted the call: {final.finish.message or 'no reason given'}")
    return None


def anthropic_router(proxy: Proxy) -> APIRouter:
    router = APIRouter()
    config = proxy.config

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        state = execution_of(proxy, request)
        body = await read_model(request, MessagesRequest, config.max_body_bytes)
        conversation = body.conversation()
        settings = CallSettings(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=tuple(body.stop_sequences or ()),
        )
        tools = body.tool_choice is None or body.tool_choice["type"] != "none"
        call = await proxy.open(state, conversation, settings, stream=body.stream)
        message_id = request_id("msg_")
        if body.stream:
            return StreamingResponse(
                _stream(proxy, call, body, message_id, tools),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "request-id": message_id},
            )
        try:
            final = await until_disconnect(request, last_generation(call), config.disconnect_poll_s)
            problem = engine_aborted(final)
            if problem is not None:
                raise problem
            parser = new_parser(settings.stop, tools, "toolu_", proxy.renderer.tool_call_separator)
            reply = Reply()
            assert final.finish is not None
            text = final_text(proxy.codec, final.output_ids, final.finish)
            reply.add(parser.feed(text.text, final=True))
            reply.close()
            await call.complete(reply.message())
        except ClientGone:
            return Response(status_code=499)
        except EngineError as e:
            raise from_engine(e) from e
        finally:
            call.abandon()
        message = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": reply.blocks,
            "stop_reason": stop_reason(final, text, reply),
            "stop_sequence": text.stop_sequence,
            "usage": {"input_tokens": call.prompt_tokens, "output_tokens": len(final.output_ids)},
        }
        return JSONResponse(message, headers={"request-id": message_id})

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        state = execution_of(proxy, request)
        body = await read_model(request, CountTokensRequest, config.max_body_bytes)
        return JSONResponse({"input_tokens": proxy.count_prompt_tokens(state, body.conversation())})

    return router


async def _stream(
    proxy: Proxy, call: ActiveCall, body: MessagesRequest, message_id: str, tools: bool
) -> AsyncIterator[str]:
    """message_start, ping, content blocks as the engine produces them, message_delta, message_stop.

    The closing events wait until the call is durable in the log; an engine failure after the 200 is sent
    as an `error` event, as Anthropic does.
    """
    parser = new_parser(tuple(body.stop_sequences or ()), tools, "toolu_", proxy.renderer.tool_call_separator)
    reply = Reply()
    try:
        yield sse(
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": body.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": call.prompt_tokens, "output_tokens": 0},
                },
            },
        )
        yield sse("ping", {"type": "ping"})
        final: Generation | None = None
        try:
            async for generation in call.generations():
                if generation.finish is not None:  # the last one: the generator ends right after it
                    final = generation
                    continue
                for event in reply.add(parser.feed(proxy.codec.decode(generation.output_ids))):
                    yield sse(*event)
        except EngineError as e:
            yield _error_event(from_engine(e))
            return
        assert final is not None
        problem = engine_aborted(final)
        if problem is not None:
            yield _error_event(problem)
            return
        assert final.finish is not None
        text = final_text(proxy.codec, final.output_ids, final.finish)
        for event in reply.add(parser.feed(text.text, final=True)) + reply.close():
            yield sse(*event)
        await call.complete(reply.message())
        yield sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason(final, text, reply), "stop_sequence": text.stop_sequence},
                "usage": {"output_tokens": len(final.output_ids)},
            },
        )
        yield sse("message_stop", {"type": "message_stop"})
    finally:
        call.abandon()


def _error_event(error: ApiError) -> str:
    return sse("error", {"type": "error", "error": {"type": ANTHROPIC_TYPES[error.kind], "message": error.message}})
