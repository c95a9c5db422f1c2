"""The API-neutral conversation both front ends translate into, and the renderer reads.

Anthropic Messages and OpenAI Chat requests become the same `Conversation`, so one conversation sent
through either API renders to the same tokens, and a reply returned through one API and echoed back through
the other still matches the record. Content is always one string: the chat template joins nothing itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]


_TOJSON = json.JSONEncoder(ensure_ascii=False)


def tojson(value: object) -> str:
    """transformers' `tojson` filter (no HTML escaping, non-ASCII kept, default separators): the same text as
    `json.dumps(value, ensure_ascii=False)`, whose non-default options build a new encoder every call (a
    rendering dumps every tool call of the re-sent conversation, so that was most of its cost)."""
    return _TOJSON.encode(value)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call made by the model. `arguments` is a JSON object (Anthropic `input`) or the JSON text
    of one (OpenAI `arguments`, copied verbatim by the template)."""

    id: str
    name: str
    arguments: Mapping[str, Any] | str

    def arguments_json(self) -> str:
        """The arguments as the chat template writes them (`tojson`, or the string verbatim)."""
        if isinstance(self.arguments, str):
            return self.arguments
        return tojson(self.arguments)

    def arguments_object(self) -> dict[str, Any]:
        """The arguments as an object (Anthropic `input`); a string that is not a JSON object becomes {}."""
        if not isinstance(self.arguments, str):
            return dict(self.arguments)
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    """Prior thinking of an assistant turn (Anthropic `thinking` blocks), rendered before the content."""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool offered to the model, in the OpenAI function shape the chat template lists."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]

    def template_dict(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class Conversation:
    """Messages in order (a leading `system` message is the system prompt) and the tools on offer."""

    messages: tuple[Message, ...]
    tools: tuple[ToolSpec, ...] = ()

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as `apply_chat_template` takes them (used by tests to check the native renderer)."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            item: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                item["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in m.tool_calls
                ]
            if m.reasoning:
                item["reasoning_content"] = m.reasoning
            out.append(item)
        return out

    def identity_text(self, stop: Callable[[str], bool] = lambda text: False) -> str:
        """What tells agents apart: the user messages before the first assistant turn and before one that
        `stop`s it (a compaction instruction), joined (the task; a harness may send its environment as a
        user message of its own first, as Codex CLI does, which alone would not tell a sub-agent from its
        parent); else the first user message, else the system prompt."""
        leading = []
        for m in self.messages:
            if m.role == "assistant" or (m.role == "user" and leading and stop(m.content)):
                break
            if m.role == "user":
                leading.append(m.content)
        if leading:
            return "\n".join(leading)
        for m in self.messages:
            if m.role == "user":
                return m.content
        return self.messages[0].content if self.messages else ""

    def last_request_text(self) -> str:
        """The newest user-side text (a user or tool message), where a compaction instruction would be."""
        for m in reversed(self.messages):
            if m.role in ("user", "tool"):
                return m.content
            if m.role == "assistant":
                return ""
        return ""
