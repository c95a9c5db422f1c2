"""Anthropic Messages API: request models (HTTP boundary) and their translation into a `Conversation`.

Messages are TypedDicts, not BaseModels: pydantic validates them as strictly but about five times faster,
which matters for a 700K-token conversation re-sent on every call. Unknown top-level fields are ignored
(harnesses send beta fields); unknown content block types are a 400 that names them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict

from gyre.proxy.conversation import Conversation, Message, ToolCall, ToolSpec
from gyre.proxy.errors import ApiError

NonEmpty = Annotated[str, Field(min_length=1)]


class TextBlock(TypedDict):
    type: Literal["text"]
    text: str
    cache_control: NotRequired[dict[str, Any] | None]
    citations: NotRequired[list[Any] | None]


class ImageBlock(TypedDict):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: NotRequired[dict[str, Any] | None]


class DocumentBlock(TypedDict):
    type: Literal["document"]
    source: dict[str, Any]


class ToolUseBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: NotRequired[dict[str, Any] | None]


class ToolResultBlock(TypedDict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: NotRequired[str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None]
    is_error: NotRequired[bool | None]
    cache_control: NotRequired[dict[str, Any] | None]


class ThinkingBlock(TypedDict):
    type: Literal["thinking"]
    thinking: str
    signature: NotRequired[str | None]


class RedactedThinkingBlock(TypedDict):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class MessageParam(TypedDict):
    role: Literal["user", "assistant", "system"]
    """`system` inside `messages` is a newer beta that Claude Code sends; it renders as a system turn."""
    content: str | list[ContentBlock]


class ToolParam(TypedDict):
    name: NonEmpty
    description: NotRequired[str | None]
    input_schema: NotRequired[dict[str, Any]]
    type: NotRequired[str | None]
    cache_control: NotRequired[dict[str, Any] | None]


class ToolChoice(TypedDict):
    type: Literal["auto", "any", "tool", "none"]
    name: NotRequired[str]
    disable_parallel_tool_use: NotRequired[bool]


class _Prompt(BaseModel):
    """Fields shared by `POST /v1/messages` and `POST /v1/messages/count_tokens`."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None

    def conversation(self) -> Conversation:
        return to_conversation(self)


class MessagesRequest(_Prompt):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[NonEmpty] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


class CountTokensRequest(_Prompt):
    pass


def _text_of(blocks: list[Any], where: str) -> str:
    parts = []
    for i, block in enumerate(blocks):
        if block["type"] != "text":
            raise ApiError(
                "invalid_request", f"{block['type']} content is not supported by this model", f"{where}.{i}.type"
            )
        parts.append(block["text"])
    return "\n".join(parts)


def to_conversation(request: _Prompt) -> Conversation:
    """Blocks become template messages: tool results become `tool` messages (in order), text becomes a user
    message, thinking becomes the assistant turn's reasoning, tool_use its tool calls."""
    return translate(request)[0]


def translate(
    request: _Prompt, start: int = 0, earlier: Sequence[tuple[Message, ...]] = ()
) -> tuple[Conversation, list[tuple[Message, ...]]]:
    """`to_conversation` of a request whose `messages` begin at index `start` (`gyre.proxy.resend`), the
    messages before translated into `earlier`; also each of its own messages' translation, one tuple each
    (a message depends on nothing else)."""
    messages: list[Message] = []
    if request.system is not None:
        system = request.system if isinstance(request.system, str) else _text_of(request.system, "system")
        messages.append(Message("system", system))
    items: list[tuple[Message, ...]] = []
    for index, param in enumerate(request.messages, start):
        where = f"messages.{index}.content"
        content = param["content"]
        if param["role"] == "assistant":
            items.append((_assistant(content, where),))
        elif param["role"] == "system":
            items.append((Message("system", content if isinstance(content, str) else _text_of(content, where)),))
        elif isinstance(content, str):
            items.append((Message("user", content),))
        else:
            items.append(tuple(_user(content, where)))
    for item in (*earlier, *items):
        messages.extend(item)
    tools = tuple(ToolSpec(t["name"], t.get("description"), t.get("input_schema") or {}) for t in request.tools or ())
    return Conversation(tuple(messages), tools), items


def _user(blocks: list[Any], where: str) -> list[Message]:
    out: list[Message] = []
    text: list[str] = []
    for i, block in enumerate(blocks):
        kind = block["type"]
        if kind == "text":
            text.append(block["text"])
            continue
        if kind == "tool_result":
            if text:
                out.append(Message("user", "\n".join(text)))
                text = []
            result = block.get("content")
            if result is None:
                result = ""
            elif not isinstance(result, str):
                result = _text_of(result, f"{where}.{i}.content")
            out.append(Message("tool", result))
            continue
        raise ApiError(
            "invalid_request", f"{kind} content is not supported in a user message by this model", f"{where}.{i}.type"
        )
    if text or not out:
        out.append(Message("user", "\n".join(text)))
    return out


def _assistant(content: str | list[Any], where: str) -> Message:
    if isinstance(content, str):
        return Message("assistant", content)
    text: list[str] = []
    thinking: list[str] = []
    calls: list[ToolCall] = []
    for i, block in enumerate(content):
        kind = block["type"]
        if kind == "text":
            text.append(block["text"])
        elif kind == "tool_use":
            calls.append(ToolCall(block["id"], block["name"], block["input"]))
        elif kind == "thinking":
            thinking.append(block["thinking"])
        elif kind != "redacted_thinking":  # opaque to this model: nothing to render
            raise ApiError(
                "invalid_request", f"{kind} content is not supported in an assistant message", f"{where}.{i}.type"
            )
    return Message("assistant", "".join(text), tuple(calls), "\n".join(thinking) or None)
