"""`POST /v1/responses` (plain and streamed), OpenAI Responses-shaped: what Codex-style harnesses speak.

Output items are built from the same `Reply` as the Anthropic front end (its content blocks map one to one
onto `message` and `function_call` items), so all three APIs record the same assistant turn for the same
output and a reply echoed through any of them matches the record.
"""

from __future__ import annotations

import json
import secrets
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
from gyre.proxy.replies import Event, Reply, final_text, new_parser
from gyre.proxy.responses_models import ResponsesRequest


def _item_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class ResponseBuilder:
    """Output items of one response, fed the `Reply`'s block events; yields Responses stream events."""

    def __init__(self, body: ResponsesRequest, response_id: str, call: ActiveCall) -> None:
        self.body = body
        self.response_id = response_id
        self.call = call
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def translate(self, events: list[Event]) -> list[str]:
        out: list[str] = []
        for name, data in events:
            index = data.get("index", 0)
            if name == "content_block_start":
                block = data["content_block"]
                if block["type"] == "text":
                    item = {
                        "type": "message",
                        "id": _item_id("msg_"),
                        "status": "in_progress",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "", "annotations": []}],
                    }
                    self.items.append(item)
                    out.append(
                        self.event("response.output_item.added", output_index=index, item={**item, "content": []})
                    )
                    out.append(
                        self.event(
                            "response.content_part.added",
                            item_id=item["id"],
                            output_index=index,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    )
                else:
                    item = {
                        "type": "function_call",
                        "id": _item_id("fc_"),
                        "call_id": block["id"],
                        "name": block["name"],
                        "arguments": "",
                        "status": "in_progress",
                    }
                    self.items.append(item)
                    out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
            elif name == "content_block_delta":
                item, delta = self.items[index], data["delta"]
                if delta["type"] == "text_delta":
                    item["content"][0]["text"] += delta["text"]
                    out.append(
                        self.event(
                            "response.output_text.delta",
                            item_id=item["id"],
                            output_index=index,
                            content_index=0,
                            delta=delta["text"],
                            logprobs=[],
                        )
                    )
                else:
                    item["arguments"] += delta["partial_json"]
                    out.append(
                        self.event(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=index,
                            delta=delta["partial_json"],
                        )
                    )
            elif name == "content_block_stop":
                item = self.items[index]
                item["status"] = "completed"
                if item["type"] == "message":
                    part = item["content"][0]
                    out.append(
                        self.event(
                            "response.output_text.done",
                            item_id=item["id"],
                            output_index=index,
                            content_index=0,
                            text=part["text"],
                            logprobs=[],
                        )
                    )
                    out.append(
                        self.event(
                            "response.content_part.done",
                            item_id=item["id"],
                            output_index=index,
                            content_index=0,
                            part=part,
                        )
                    )
                else:
                    out.append(
                        self.event(
                            "response.function_call_arguments.done",
                            item_id=item["id"],
                            output_index=index,
                            name=item["name"],
                            arguments=item["arguments"],
                        )
                    )
                out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def response(self, final: Generation | None) -> dict[str, Any]:
        """The response object: in progress while `final` is None, else completed or incomplete."""
        body = self.body
        status, incomplete, usage = "in_progress", None, None
        if final is not None:
            assert final.finish is not None
            status = "incomplete" if final.finish.type == "length" else "completed"
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
            output = len(final.output_ids)
            prompt = self.call.prompt_tokens
            usage = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": self.call.cached_tokens},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output,
            }
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": body.model,
            "output": self.items if final is not None else [],
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": body.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": body.metadata or {},
        }


def responses_router(proxy: Proxy) -> APIRouter:
    router = APIRouter()
    config = proxy.config

    @router.post("/v1/responses")
    async def responses(request: Request) -> Response:
        state = execution_of(proxy, request)
        body = await read_model(request, ResponsesRequest, config.max_body_bytes)
        body.check_supported()
        conversation = body.conversation_of()
        settings = CallSettings(
            max_tokens=body.max_output_tokens or config.default_max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
        )
        call = await proxy.open(state, conversation, settings, stream=body.stream)
        builder = ResponseBuilder(body, request_id("resp_"), call)
        if body.stream:
            return StreamingResponse(
                _stream(proxy, call, builder),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", "x-request-id": builder.response_id},
            )
        try:
            final = await until_disconnect(request, last_generation(call), config.disconnect_poll_s)
            if (problem := engine_aborted(final)) is not None:
                raise problem
            assert final.finish is not None
            reply = Reply()
            text = final_text(proxy.codec, final.output_ids, final.finish)
            parser = new_parser((), body.tools_enabled, "call_", proxy.renderer.tool_call_separator)
            builder.translate(reply.add(parser.feed(text.text, final=True)) + reply.close())
            await call.complete(reply.message())
        except ClientGone:
            return Response(status_code=499)
        except EngineError as e:
            raise from_engine(e) from e
        finally:
            call.abandon()
        return JSONResponse(builder.response(final), headers={"x-request-id": builder.response_id})

    return router


async def _stream(proxy: Proxy, call: ActiveCall, builder: ResponseBuilder) -> AsyncIterator[str]:
    """response.created, in_progress, item events as the engine produces them, then response.completed (or
    response.incomplete), sent only once the call is durable; an engine failure is a `response.failed`."""
    parser = new_parser((), builder.body.tools_enabled, "call_", proxy.renderer.tool_call_separator)
    reply = Reply()
    try:
        yield builder.event("response.created", response=builder.response(None))
        yield builder.event("response.in_progress", response=builder.response(None))
        final: Generation | None = None
        try:
            async for generation in call.generations():
                if generation.finish is not None:
                    final = generation
                    continue
                for item in builder.translate(reply.add(parser.feed(proxy.codec.decode(generation.output_ids)))):
                    yield item
        except EngineError as e:
            yield _failed(builder, from_engine(e))
            return
        assert final is not None and final.finish is not None
        if final.finish.type == "abort":
            yield _failed(builder, ApiError("overloaded", "the engine aborted the call"))
            return
        text = final_text(proxy.codec, final.output_ids, final.finish)
        for item in builder.translate(reply.add(parser.feed(text.text, final=True)) + reply.close()):
            yield item
        await call.complete(reply.message())
        response = builder.response(final)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield builder.event(kind, response=response)
    finally:
        call.abandon()


def _failed(builder: ResponseBuilder, error: ApiError) -> str:
    _, body = error_body("openai", error, "")
    response = builder.response(None)
    response.update(status="failed", error={"code": body["error"]["code"] or "server_error", "message": error.message})
    return builder.event("response.failed", response=response)
