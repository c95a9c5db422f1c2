"""`POST /v1/responses` (plain and streamed), OpenAI Responses-shaped: what Codex-style harnesses speak.

Output items are built from the same `Reply` as the Anthropic front end (its content blocks map one to one
onto `message` and call items), so all three APIs record the same assistant turn for the same output and a
reply echoed through any of them matches the record. A tool call becomes the item of the tool's kind
(`ToolPlan.route`): `function_call` (with its `namespace` for a namespaced tool), `custom_tool_call`, or
`local_shell_call`.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gyre.proxy.conversation import tojson
from gyre.proxy.core import ActiveCall, CallSettings, Generation, Proxy
from gyre.proxy.errors import ApiError
from gyre.proxy.http import error_body, execution_of, read_model, request_id
from gyre.proxy.output import Piece
from gyre.proxy.replies import Event, FinalText, Reply
from gyre.proxy.responses_models import (
    ReasoningConfig,
    ResponsesRequest,
    ToolPlan,
    custom_input,
    shell_action,
)
from gyre.proxy.turn import answer


def _item_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class ResponseBuilder:
    """Output items of one response, fed the `Reply`'s block events; yields Responses stream events. The
    Responses rendering of one call (`gyre.proxy.turn.FrontEnd`)."""

    stop: tuple[str, ...] = ()
    id_prefix = "call_"
    keep_blank_text = False

    def __init__(
        self, body: ResponsesRequest, response_id: str, call: ActiveCall, plan: ToolPlan,
        history: list[Any] | None = None,
    ) -> None:
        self.body = body
        self.plan = plan
        self.history = history
        """The items this response continues (resolved history and input): stored with its output when
        `history` is not None (the request's `store`)."""
        self.raw: dict[int, str] = {}
        self.response_id = response_id
        self.call = call
        self.created = int(time.time())
        self.items: list[dict[str, Any]] = []
        self.sequence = 0
        self.tools = body.tools_enabled
        self.headers = {"x-request-id": response_id}

    def opening(self) -> list[str]:
        return [
            self.event("response.created", response=self.response(None)),
            self.event("response.in_progress", response=self.response(None)),
        ]

    def deltas(self, reply: Reply, pieces: list[Piece], *, last: bool) -> list[str]:
        return self.translate(reply.add(pieces) + (reply.close() if last else []))

    def settle(self, reply: Reply, pieces: list[Piece]) -> None:
        self.deltas(reply, pieces, last=True)  # the events build `items`, which the answer is made of

    def closing(self, final: Generation, text: FinalText, reply: Reply) -> list[str]:
        self.keep()
        response = self.response(final)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [self.event(kind, response=response)]

    def failed(self, error: ApiError) -> str:
        _, body = error_body("openai", error, "")
        code = body["error"]["code"] or body["error"]["type"]  # a refusal stays the harness's error
        response = self.response(None)
        response.update(status="failed", error={"code": code, "message": error.message})
        return self.event("response.failed", response=response)

    def plain(self, final: Generation, text: FinalText, reply: Reply) -> dict[str, Any]:
        self.keep()
        return self.response(final)

    def keep(self) -> None:
        """Store the finished response for `previous_response_id` (its call is recorded by now)."""
        if self.history is not None:
            self.call.state.responses.keep(self.response_id, [*self.history, *self.items])

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {tojson(data)}\n\n"

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
                    item = self.call_item(block)
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
                elif item["type"] == "function_call":
                    item["arguments"] += delta["partial_json"]
                    out.append(
                        self.event(
                            "response.function_call_arguments.delta",
                            item_id=item["id"],
                            output_index=index,
                            delta=delta["partial_json"],
                        )
                    )
                else:
                    self.raw[index] = self.raw.get(index, "") + delta["partial_json"]
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
                elif item["type"] == "function_call":
                    out.append(
                        self.event(
                            "response.function_call_arguments.done",
                            item_id=item["id"],
                            output_index=index,
                            name=item["name"],
                            arguments=item["arguments"],
                        )
                    )
                else:
                    out += self.finish_call(index, item)
                out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def call_item(self, block: dict[str, Any]) -> dict[str, Any]:
        """The output item a tool call opens, by the kind of tool it calls (`ToolPlan.route`)."""
        route = self.plan.route(block["name"])
        call_id, status = block["id"], "in_progress"
        if route.kind == "custom":
            return {"type": "custom_tool_call", "id": _item_id("ctc_"), "call_id": call_id, "status": status,
                    "name": route.name, "input": ""}
        if route.kind == "local_shell":
            return {"type": "local_shell_call", "id": _item_id("lsh_"), "call_id": call_id, "status": status,
                    "action": shell_action({"command": []})}
        item = {"type": "function_call", "id": _item_id("fc_"), "call_id": call_id, "status": status,
                "name": route.name, "arguments": ""}
        if route.namespace is not None:
            item["namespace"] = route.namespace
        return item

    def finish_call(self, index: int, item: dict[str, Any]) -> list[str]:
        """Complete a custom or local shell call item from the arguments the model wrote (one JSON object)."""
        arguments = json.loads(self.raw.pop(index, "") or "{}")
        if item["type"] == "local_shell_call":
            item["action"] = shell_action(arguments)
            return []
        item["input"] = custom_input(arguments)
        fields = {"item_id": item["id"], "output_index": index}
        return [
            self.event("response.custom_tool_call_input.delta", **fields, delta=item["input"]),
            self.event("response.custom_tool_call_input.done", **fields, input=item["input"]),
        ]

    def response(self, final: Generation | None) -> dict[str, Any]:
        """The response object: in progress while `final` is None, else completed or incomplete."""
        body = self.body
        reasoning = body.reasoning or ReasoningConfig()
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
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary},
            "store": body.stored,
            "prompt_cache_key": body.prompt_cache_key,
            "temperature": body.temperature,
            "text": {"format": {"type": "text"}, "verbosity": body.text.verbosity if body.text else None},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": body.metadata or {},
        }


def responses_routes(proxy: Proxy) -> list[Route]:
    config = proxy.config

    async def responses(request: Request) -> Response:
        state = execution_of(proxy, request)
        body = await read_model(request, ResponsesRequest, config.max_body_bytes)
        body.check_supported()
        plan = body.tool_plan()
        entries = state.responses.expand(body.previous_response_id, body.input_items())
        conversation = body.conversation_of(plan, entries)
        settings = CallSettings(
            max_tokens=body.max_output_tokens or config.default_max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
        )
        call = await proxy.open(state, conversation, settings, stream=body.stream, dropped_tools=plan.dropped)
        history = [item for _, item in entries] if body.stored else None
        return await answer(request, proxy, call, ResponseBuilder(body, request_id("resp_"), call, plan, history))

    return [Route("/v1/responses", responses, methods=["POST"])]
