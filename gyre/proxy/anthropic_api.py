"""`POST /v1/messages` (plain and streamed) and `POST /v1/messages/count_tokens`, Anthropic-shaped."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gyre.proxy.anthropic_models import CountTokensRequest, MessagesRequest, translate
from gyre.proxy.conversation import tojson
from gyre.proxy.core import ActiveCall, CallSettings, Generation, Proxy
from gyre.proxy.errors import ApiError
from gyre.proxy.http import ANTHROPIC_TYPES, execution_of, read_model, read_resent_model, request_id
from gyre.proxy.output import Piece
from gyre.proxy.replies import FinalText, Reply
from gyre.proxy.turn import answer


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {tojson(data)}\n\n"


def stop_reason(final: Generation, text: FinalText, reply: Reply) -> str:
    assert final.finish is not None
    if final.finish.type == "length":
        return "max_tokens"
    if text.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if reply.calls else "end_turn"


class _Messages:
    """The Anthropic Messages rendering of one call (`gyre.proxy.turn.FrontEnd`)."""

    id_prefix = "toolu_"
    keep_blank_text = False

    def __init__(self, body: MessagesRequest, call: ActiveCall, message_id: str) -> None:
        self.body = body
        self.call = call
        self.message_id = message_id
        self.stop = tuple(body.stop_sequences or ())
        self.tools = body.tool_choice is None or body.tool_choice["type"] != "none"
        self.headers = {"request-id": message_id}

    def opening(self) -> list[str]:
        start = {"type": "message_start", "message": {**self._message([], None, None), "usage": self._usage(0)}}
        return [sse("message_start", start), sse("ping", {"type": "ping"})]

    def deltas(self, reply: Reply, pieces: list[Piece], *, last: bool) -> list[str]:
        events = reply.add(pieces) + (reply.close() if last else [])
        return [sse(*event) for event in events]

    def settle(self, reply: Reply, pieces: list[Piece]) -> None:
        reply.add(pieces)
        reply.close()

    def closing(self, final: Generation, text: FinalText, reply: Reply) -> list[str]:
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(final, text, reply), "stop_sequence": text.stop_sequence},
            "usage": {"output_tokens": len(final.output_ids)},
        }
        return [sse("message_delta", delta), sse("message_stop", {"type": "message_stop"})]

    def failed(self, error: ApiError) -> str:
        return sse("error", {"type": "error", "error": {"type": ANTHROPIC_TYPES[error.kind], "message": error.message}})

    def plain(self, final: Generation, text: FinalText, reply: Reply) -> dict[str, Any]:
        message = self._message(reply.blocks, stop_reason(final, text, reply), text.stop_sequence)
        return {**message, "usage": self._usage(len(final.output_ids))}

    def _message(self, content: list[dict[str, Any]], stop: str | None, sequence: str | None) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.body.model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": sequence,
        }

    def _usage(self, output_tokens: int) -> dict[str, int]:
        return {"input_tokens": self.call.prompt_tokens, "output_tokens": output_tokens}


def anthropic_routes(proxy: Proxy) -> list[Route]:
    config = proxy.config

    async def messages(request: Request) -> Response:
        state = execution_of(proxy, request)
        resent = await read_resent_model(request, MessagesRequest, "messages", state, config.max_body_bytes)
        body = resent.body
        conversation, items = translate(body, resent.start, resent.earlier)
        resent.remember(items)
        settings = CallSettings(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=tuple(body.stop_sequences or ()),
        )
        call = await proxy.open(state, conversation, settings, stream=body.stream)
        return await answer(request, proxy, call, _Messages(body, call, request_id("msg_")))

    async def count_tokens(request: Request) -> Response:
        state = execution_of(proxy, request)
        body = await read_model(request, CountTokensRequest, config.max_body_bytes)
        return JSONResponse({"input_tokens": proxy.count_prompt_tokens(state, body.conversation())})

    return [
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]
