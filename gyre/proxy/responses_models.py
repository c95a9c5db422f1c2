"""OpenAI Responses API: the request model (HTTP boundary) and its translation into a `Conversation`.

The proxy is stateless towards the harness (its record is the event log, not a response store), so a request
carries its whole history in `input`: `previous_response_id`, `conversation` and `item_reference` items are a
400 that says so. Consecutive assistant output items (`message`, `function_call`) form one assistant turn,
as the chat template renders it; `reasoning` items are accepted and not rendered (this proxy produces none).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from gyre.proxy.conversation import Conversation, Message, ToolCall, ToolSpec
from gyre.proxy.errors import ApiError

_TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.previous_response_id is not None:
            raise ApiError(
                "invalid_request",
                "previous_response_id is not supported: the proxy stores no responses; send the whole history "
                "in `input` (store=false)",
                "previous_response_id",
            )
        if self.conversation is not None:
            raise ApiError(
                "invalid_request", "conversation is not supported: send the history in `input`", "conversation"
            )
        fmt = (self.text or {}).get("format") or {}
        if fmt.get("type") not in (None, "text"):
            raise ApiError("invalid_request", "only text.format type 'text' is supported", "text.format.type")

    @property
    def tools_enabled(self) -> bool:
        return self.tool_choice != "none"

    def conversation_of(self) -> Conversation:
        messages: list[Message] = []
        if self.instructions is not None:
            messages.append(Message("system", self.instructions))
        items: list[dict[str, Any]] = (
            [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        )
        turn: _Turn | None = None
        for index, item in enumerate(items):
            where = f"input.{index}"
            if not isinstance(item, dict):
                raise ApiError("invalid_request", "each input item must be an object", where)
            kind = item.get("type", "message")
            if kind == "message" and item.get("role") == "assistant":
                if turn is not None and turn.calls:  # text after a call is a new turn in the template
                    messages.append(turn.message())
                    turn = None
                turn = turn or _Turn()
                turn.texts.append(_text(item.get("content"), where))
                continue
            if kind == "function_call":
                turn = turn or _Turn()
                turn.calls.append(_function_call(item, where))
                continue
            if kind == "reasoning":
                continue
            if turn is not None:
                messages.append(turn.message())
                turn = None
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "system", "developer"):
                    raise ApiError("invalid_request", f"unknown message role {role!r}", f"{where}.role")
                messages.append(Message("user" if role == "user" else "system", _text(item.get("content"), where)))
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append(Message("tool", output if isinstance(output, str) else _text(output, where)))
            elif kind == "item_reference":
                raise ApiError(
                    "invalid_request", "item_reference is not supported: the proxy stores no items", f"{where}.type"
                )
            else:
                raise ApiError("invalid_request", f"input items of type {kind!r} are not supported", f"{where}.type")
        if turn is not None:
            messages.append(turn.message())
        return Conversation(tuple(messages), self._tools())

    def _tools(self) -> tuple[ToolSpec, ...]:
        specs = []
        for i, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function":
                raise ApiError(
                    "invalid_request",
                    f"tools of type {tool.get('type')!r} are not supported (only 'function')",
                    f"tools.{i}.type",
                )
            name = tool.get("name")
            if not isinstance(name, str) or not name:
                raise ApiError("invalid_request", "a function tool needs a non-empty name", f"tools.{i}.name")
            specs.append(ToolSpec(name, tool.get("description"), tool.get("parameters") or {}))
        return tuple(specs)


class _Turn:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.calls: list[ToolCall] = []

    def message(self) -> Message:
        return Message("assistant", "".join(self.texts), tuple(self.calls))


def _function_call(item: dict[str, Any], where: str) -> ToolCall:
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str):
            raise ApiError("invalid_request", f"a function_call item needs a string {field}", f"{where}.{field}")
    return ToolCall(item["call_id"], item["name"], item["arguments"])


def _text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError("invalid_request", "content must be a string or a list of parts", f"{where}.content")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise ApiError(
                "invalid_request", f"{kind} content is not supported by this model", f"{where}.content.{i}.type"
            )
        parts.append(part.get("refusal" if kind == "refusal" else "text") or "")
    return "".join(parts)
