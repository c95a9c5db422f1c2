"""OpenAI Chat Completions: request models (HTTP boundary) and their translation into a `Conversation`.

Messages are TypedDicts for speed (see `anthropic_models`). Options this proxy cannot honour (n > 1,
top_logprobs, penalties, structured output) are a 400 that names them rather than being ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import TypedDict

from gyre.proxy.conversation import Conversation, Message, ToolCall, ToolSpec
from gyre.proxy.errors import ApiError


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class ImagePart(TypedDict):
    type: Literal["image_url"]
    image_url: dict[str, Any]


class RefusalPart(TypedDict):
    type: Literal["refusal"]
    refusal: str


UserPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


class FunctionCall(TypedDict):
    name: str
    arguments: str


class ToolCallParam(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class SystemMessage(TypedDict):
    role: Literal["system", "developer"]
    content: str | list[TextPart]
    name: NotRequired[str]


class UserMessage(TypedDict):
    role: Literal["user"]
    content: str | list[UserPart]
    name: NotRequired[str]


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: NotRequired[str | list[AssistantPart] | None]
    tool_calls: NotRequired[list[ToolCallParam] | None]
    reasoning_content: NotRequired[str | None]
    refusal: NotRequired[str | None]
    name: NotRequired[str]


class ToolMessage(TypedDict):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class FunctionDef(TypedDict):
    name: Annotated[str, Field(min_length=1)]
    description: NotRequired[str | None]
    parameters: NotRequired[dict[str, Any]]
    strict: NotRequired[bool | None]


class ToolDef(TypedDict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(TypedDict):
    name: str


class NamedToolChoice(TypedDict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(TypedDict):
    include_usage: NotRequired[bool | None]


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stop: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise ApiError("invalid_request", "n must be 1: the proxy records one sample per call", "n")
        if self.top_logprobs:
            raise ApiError("invalid_request", "top_logprobs is not supported", "top_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError("invalid_request", f"{name} is not supported", name)
        if self.response_format is not None and self.response_format.get("type") not in (None, "text"):
            raise ApiError("invalid_request", "only response_format type 'text' is supported", "response_format.type")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def conversation(self) -> Conversation:
        return self.translate()[0]

    def translate(self, start: int = 0, earlier: Sequence[Message] = ()) -> tuple[Conversation, list[Message]]:
        """`conversation` of a request whose `messages` begin at index `start` (`gyre.proxy.resend`), those
        before translated into `earlier`; also its own messages' translations (each depends on nothing else)."""
        items = [_message(m, f"messages.{i}") for i, m in enumerate(self.messages, start)]
        tools = tuple(
            ToolSpec(t["function"]["name"], t["function"].get("description"), t["function"].get("parameters") or {})
            for t in self.tools or ()
        )
        return Conversation((*earlier, *items), tools), items


def _text(content: str | list[Any] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part["type"] == "text":
            parts.append(part["text"])
        elif part["type"] == "refusal":
            parts.append(part["refusal"])
        else:
            raise ApiError(
                "invalid_request", f"{part['type']} content is not supported by this model", f"{where}.content.{i}.type"
            )
    return "".join(parts)


def _message(m: Any, where: str) -> Message:
    role = m["role"]
    if role in ("system", "developer"):
        return Message("system", _text(m["content"], where))
    if role == "user":
        return Message("user", _text(m["content"], where))
    if role == "tool":
        return Message("tool", _text(m["content"], where))
    calls = tuple(
        ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()
    )
    return Message("assistant", _text(m.get("content"), where), calls, m.get("reasoning_content") or None)
