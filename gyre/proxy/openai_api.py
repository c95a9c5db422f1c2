"""`POST /v1/chat/completions` (plain and streamed) and `GET /v1/models`, OpenAI-shaped."""

from __future__ import annotations

import json
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gyre.proxy.conversation import tojson
from gyre.proxy.core import ActiveCall, CallSettings, Generation, Proxy
from gyre.proxy.errors import ApiError
from gyre.proxy.http import error_body, execution_of, read_resent_model, request_id
from gyre.proxy.openai_models import ChatCompletionRequest
from gyre.proxy.output import Piece, TextPiece
from gyre.proxy.replies import FinalText, Reply
from gyre.proxy.tokens import TokenCodec
from gyre.proxy.turn import answer


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


class _ChatCompletion:
    """The OpenAI Chat Completions rendering of one call (`gyre.proxy.turn.FrontEnd`)."""

    id_prefix = "call_"
    keep_blank_text = True

    def __init__(self, proxy: Proxy, body: ChatCompletionRequest, call: ActiveCall, completion_id: str) -> None:
        self.codec = proxy.codec
        self.body = body
        self.call = call
        self.completion_id = completion_id
        self.created = int(time.time())
        self.stop = body.stop_strings
        self.tools = body.tool_choice != "none"
        self.include_usage = bool(body.stream_options and body.stream_options.get("include_usage"))
        self.headers = {"x-request-id": completion_id}

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        data: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.body.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.include_usage:
            data["usage"] = None
        return f"data: {tojson(data)}\n\n"

    def opening(self) -> list[str]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def deltas(self, reply: Reply, pieces: list[Piece], *, last: bool) -> list[str]:
        out = []
        first_call = len(reply.calls)
        reply.add(pieces)
        if last:
            reply.close()
        for piece in pieces:
            if isinstance(piece, TextPiece):
                if piece.text:
                    out.append(self._chunk({"content": piece.text}))
            else:
                out.append(self._chunk({"tool_calls": [_tool_call_json(first_call, piece.call)]}))
                first_call += 1
        return out

    def settle(self, reply: Reply, pieces: list[Piece]) -> None:
        reply.add(pieces)
        reply.close()

    def closing(self, final: Generation, text: FinalText, reply: Reply) -> list[str]:
        out = [self._chunk({}, _finish_reason(final, reply))]
        if self.include_usage:
            usage = {
                "id": self.completion_id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.body.model,
                "choices": [],
                "usage": _usage(self.call, final),
            }
            out.append(f"data: {json.dumps(usage)}\n\n")
        return [*out, "data: [DONE]\n\n"]

    def failed(self, error: ApiError) -> str:
        _, body = error_body("openai", error, "")
        return f"data: {json.dumps(body)}\n\n"

    def plain(self, final: Generation, text: FinalText, reply: Reply) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": reply.text or (None if reply.calls else ""),
            "refusal": None,
        }
        if reply.calls:
            message["tool_calls"] = [_tool_call_json(None, c) for c in reply.calls]
        logprobs = (
            _logprobs(self.codec, self.call, _visible_tokens(self.codec, final.output_ids))
            if self.body.logprobs
            else None
        )
        return {
            "id": self.completion_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.body.model,
            "choices": [
                {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": _finish_reason(final, reply)}
            ],
            "usage": _usage(self.call, final),
        }


def openai_routes(proxy: Proxy) -> list[Route]:
    config = proxy.config

    async def models(request: Request) -> Response:
        execution_of(proxy, request)
        return JSONResponse(
            {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0, "owned_by": "gyre"}]}
        )

    async def chat_completions(request: Request) -> Response:
        state = execution_of(proxy, request)
        resent = await read_resent_model(request, ChatCompletionRequest, "messages", state, config.max_body_bytes)
        body = resent.body
        body.check_supported()
        conversation, items = body.translate(resent.start, resent.earlier)
        resent.remember(items)
        max_tokens = body.max_completion_tokens or body.max_tokens or config.default_max_tokens
        settings = CallSettings(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            stop=body.stop_strings,
            seed=body.seed,
        )
        call = await proxy.open(state, conversation, settings, stream=body.stream)
        return await answer(request, proxy, call, _ChatCompletion(proxy, body, call, request_id("chatcmpl-")))

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
