"""Rendering a conversation as *units*: pieces of prompt text whose boundaries are token boundaries.

TITO needs to know which part of a rendered conversation is old (already recorded as exact ids) and which is
new, without re-rendering or re-tokenising the whole conversation on every call (that would cost O(context)
per call). So the renderer emits the prompt as a list of units, one per message (a run of tool results is
one unit), each a pure function of the messages before it. An assistant turn is two units: the generation
prompt (`GEN`, what the proxy appends before the model writes) and the body (what the model wrote, ending
with its end-of-turn token). Every unit boundary sits next to a special or added token, so encoding units
one by one gives the same ids as encoding the whole text (a test checks this against the jinja template).

`ChatMLRenderer` reproduces `gyre.model.chat_template.CHAT_TEMPLATE` exactly (Qwen2.5-style ChatML with
`<tool_call>` tags) in Python. A checkpoint with its own template gets `gyre.proxy.template_render.
TemplateRenderer`, which renders that jinja template and cuts it into units with the same contract.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from gyre.proxy.conversation import Conversation, Message, tojson

UnitKind = Literal["context", "gen", "body"]


@dataclass(frozen=True, slots=True)
class Unit:
    """One piece of rendered prompt. `body` units are assistant turns: what a model call would have output."""

    text: str
    kind: UnitKind = "context"


@dataclass(frozen=True, slots=True)
class Rendering:
    """A conversation's units, and how many earlier assistant turns the template renders differently now
    from how they were rendered when the model wrote them (Qwen3 drops earlier `<think>`)."""

    units: list[Unit]
    rewritten: int = 0


class ChatRenderer(Protocol):
    """Renders conversations as units (see the module docstring for the contract)."""

    tool_call_separator: str
    """What the template writes between a turn's text and its first tool call."""

    def render(self, conversation: Conversation) -> Rendering:
        """`units`, with what the template rewrote."""
        ...

    def units(self, conversation: Conversation) -> list[Unit]:
        """All units of the prompt, ending with the generation prompt (`gen`)."""
        ...

    def assistant_body(self, message: Message) -> str:
        """The text a model writes for `message` after the generation prompt, end-of-turn token included."""
        ...


IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOLS_PREAMBLE = "# Tools\n\nYou may call one or more functions. Their signatures are inside <tools></tools>:\n<tools>"
TOOLS_POSTAMBLE = (
    '\n</tools>\n\nTo call a function, write <tool_call>{"name": <function-name>, '
    '"arguments": <args-json-object>}</tool_call>.'
)


class ChatMLRenderer:
    """The tiny model's chat template, unit by unit. Stateless and cheap: O(characters rendered)."""

    gen_text = f"{IM_START}assistant\n"
    tool_call_separator = ""

    def header(self, conversation: Conversation) -> str | None:
        """The system turn (system prompt and tool list), or None when there is neither."""
        messages = conversation.messages
        system = messages[0].content if messages and messages[0].role == "system" else None
        if conversation.tools:
            text = f"{IM_START}system\n"
            if system is not None:
                text += system + "\n\n"
            text += TOOLS_PREAMBLE + "".join("\n" + tojson(t.template_dict()) for t in conversation.tools)
            return text + TOOLS_POSTAMBLE + IM_END
        if system is not None:
            return f"{IM_START}system\n{system}{IM_END}"
        return None

    def assistant_body(self, message: Message) -> str:
        text = f"<think>\n{message.reasoning}\n</think>\n\n" if message.reasoning else ""
        text += message.content
        for call in message.tool_calls:
            text += f'<tool_call>{{"name": {tojson(call.name)}, "arguments": {call.arguments_json()}}}</tool_call>'
        return text + IM_END

    def render(self, conversation: Conversation) -> Rendering:
        return Rendering(self.units(conversation))  # this template never rewrites history

    def units(self, conversation: Conversation) -> list[Unit]:
        units: list[Unit] = []
        header = self.header(conversation)
        if header is not None:
            units.append(Unit(header))
        messages = conversation.messages
        start = 1 if messages and messages[0].role == "system" else 0
        i = start
        while i < len(messages):
            sep = "\n" if units else ""
            message = messages[i]
            if message.role == "tool":
                run: list[str] = []
                while i < len(messages) and messages[i].role == "tool":
                    run.append(f"\n<tool_response>\n{messages[i].content}\n</tool_response>")
                    i += 1
                units.append(Unit(f"{sep}{IM_START}user{''.join(run)}{IM_END}"))
                continue
            if message.role == "assistant":
                units.append(Unit(sep + self.gen_text, "gen"))
                units.append(Unit(self.assistant_body(message), "body"))
            else:  # user, or a system message after the first
                units.append(Unit(f"{sep}{IM_START}{message.role}\n{message.content}{IM_END}"))
            i += 1
        units.append(Unit(("\n" if units else "") + self.gen_text, "gen"))
        return units


def prompt_text(units: Sequence[Unit]) -> str:
    return "".join(u.text for u in units)
