"""`POST /v1/chat/completions` (plain and streamed) and `GET /v1/models`, OpenAI-shaped."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gyre.engine import EngineError
from gyre.proxy.anthropic_api import engine_aborted, last_generation
from gyre.proxy.core import ActiveCall, CallSettings, Generation, Proxy
from gyre.proxy.errors import ApiError
from gyre.proxy.http import ClientGone, error_body, execution_of, from_engine, read_model, request_id, until_disconnect
from gyre.proxy.openai_models import ChatCompletionRequest
from gyre.proxy.output import Piece, TextPiece
from gyre.proxy.replies import Reply, final_text, new_parser
from gyre.proxy.tokens import TokenCodec


def _finish_reason(final: Generation, reply: Reply) -> str:
    assert final.finish is not None
    if final.finish.type == "length":
        return "length"
    return "tool_calls" if reply.calls else "stop"


def _usage(call: ActiveCall, final: Generation) -> dict[str, Any]:
    completion = len(final.output_ids)
    return {
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": call.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": call.cached_tokens},
    }


def _tool_call_json(index: int | None, call: Any) -> dict[str, Any]:
    item: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json()},
    }
    return item if index is None else {"index": index, **item}


def _logprobs(codec: TokenCodec, call: ActiveCall, visible_tokens: int) -> dict[str, Any]:
    content = []
    for token, logprob in zip(call.output_ids[:visible_tokens], call.logprobs[:visible_tokens], strict=True):
        content.append(
            {
                "token": codec.token_text(token),
                "logprob": logprob,
                "bytes": list(codec.token_bytes(token)),
                "top_logprobs": [],
            }
        )
    return {"content": content, "refusal": None}


def _visible_tokens(codec: TokenCodec, output_ids: list[int]) -> int:
    """Output tokens listed in `logprobs`: all but a final stop token (OpenAI does not list it)."""
    return len(output_ids) - 1 if output_ids and output_ids[-1] in codec.special_ids else len(output_ids)


def openai_router(proxy: Proxy) -> APIRouter:
    router = APIRouter()
    config = proxy.config

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        execution_of(proxy, request)
        return JSONResponse(
            {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0, "owned_by": "gyre"}]}
        )

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        state = execution_of(proxy, request)
        body = await read_model(request, ChatCompletionRequest, config.max_body_bytes)
        body.check_supported()
        conversation = body.conversation()
        max_tokens = body.max_completion_tokens or body.max_tokens or config.default_max_tokens
        settings = CallSettings(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stop_strings,
            seed=body.seed,
        )
        tools = body.tool_choice != "none"
        call = await proxy.open(state, conversation, settings, stream=body.stream)
        completion_id = request_id("chatcmpl-")
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.get("include_usage"))
            return StreamingResponse(
                _stream(proxy, call, body, completion_id, tools, include_usage),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-request-id": completion_id},
            )
        try:
            final = await until_disconnect(request, last_generation(call), config.disconnect_poll_s)
            if (problem := engine_aborted(final)) is not None:
                raise problem
            parser = new_parser(settings.stop, tools, "call_", proxy.renderer.tool_call_separator)
            reply = Reply(keep_blank_text=True)
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
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reply.text or (None if reply.calls else ""),
            "refusal": None,
        }
        if reply.calls:
            message["tool_calls"] = [_tool_call_json(None, c) for c in reply.calls]
        logprobs = (
            _logprobs(proxy.codec, call, _visible_tokens(proxy.codec, final.output_ids)) if body.logprobs else None
        )
        return JSONResponse(
            {
                "id": completion_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body.model,
                "choices": [
                    {
                        "index": 0,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": _finish_reason(final, reply),
                    }
                ],
                "usage": _usage(call, final),
            },
            headers={"x-request-id": completion_id},
        )

    return router


async def _stream(
    proxy: Proxy, call: ActiveCall, body: ChatCompletionRequest, completion_id: str, tools: bool, include_usage: bool
) -> AsyncIterator[str]:
    """Role chunk, content and tool-call deltas, a finish chunk, then a usage chunk when asked, `[DONE]`."""
    created = int(time.time())
    parser = new_parser(body.stop_strings, tools, "call_", proxy.renderer.tool_call_separator)
    reply = Reply(keep_blank_text=True)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        data: dict[str, Any] = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": body.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if include_usage:
            data["usage"] = None
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

    def deltas(pieces: list[Piece]) -> list[str]:
        out = []
        first_call = len(reply.calls)
        reply.add(pieces)
        for piece in pieces:
            if isinstance(piece, TextPiece):
                if piece.text:
                    out.append(chunk({"content": piece.text}))
            else:
                out.append(chunk({"tool_calls": [_tool_call_json(first_call, piece.call)]}))
                first_call += 1
        return out

    try:
        yield chunk({"role": "assistant", "content": ""})
        final: Generation | None = None
        try:
            async for generation in call.generations():
                if generation.finish is not None:  # the last one: the generator ends right after it
                    final = generation
                    continue
                for item in deltas(parser.feed(proxy.codec.decode(generation.output_ids))):
                    yield item
        except EngineError as e:
            yield _error_chunk(from_engine(e))
            return
        assert final is not None and final.finish is not None
        if final.finish.type == "abort":
            yield _error_chunk(ApiError("overloaded", "the engine aborted the call"))
            return
        text = final_text(proxy.codec, final.output_ids, final.finish)
        for item in deltas(parser.feed(text.text, final=True)):
            yield item
        reply.close()
        await call.complete(reply.message())
        yield chunk({}, _finish_reason(final, reply))
        if include_usage:
            usage = {
                "id": completion_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.model,
                "choices": [],
                "usage": _usage(call, final),
            }
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        call.abandon()


def _error_chunk(error: ApiError) -> str:
    _, body = error_body("openai", error, "")
    return f"data: {json.dumps(body)}\n\n"
