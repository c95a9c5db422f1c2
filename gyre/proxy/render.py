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
from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True, eq=False)
class Rendered:
    """A conversation's units but the final generation prompt, kept per execution so that its next call's
    rendering reuses them for the messages it shares (the same `Message` objects: `gyre.proxy.resend`
    hands a front end the very objects it translated a re-sent message into before)."""

    header: str | None
    messages: tuple[Message, ...]
    units: list[Unit]
    starts: list[int | None] = field(default_factory=list)
    """`starts[i]`: the units before message i's; None where message i continues a run of tool results
    (one unit). `starts[len(messages)] == len(units)`."""


KEEP_RENDERED = 4
"""Renderings kept per execution: its agents (a main conversation and sub-agents) interleave calls."""


class ChatRenderer(Protocol):
    """Renders conversations as units (see the module docstring for the contract)."""

    tool_call_separator: str
    """What the template writes between a turn's text and its first tool call."""

    def render(self, conversation: Conversation, kept: list[Rendered] | None = None) -> Rendering:
        """`units`, with what the template rewrote. `kept`: the execution's earlier renderings, which a
        renderer may extend (updated in place) or ignore."""
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

    def render(self, conversation: Conversation, kept: list[Rendered] | None = None) -> Rendering:
        """The units; with `kept`, those of the longest run of leading messages shared with a kept rendering
        (the same objects, the same header) are reused, and this rendering is kept. This template never
        rewrites history."""
        header = self.header(conversation)
        messages = conversation.messages
        first = _first(messages)
        units, starts = self._reused(header, messages, first, kept or ())
        if not starts:
            units = [Unit(header)] if header is not None else []
            starts = [0] * first
        i = len(starts)
        while i < len(messages):
            sep = "\n" if units else ""
            message = messages[i]
            starts.append(len(units))
            if message.role == "tool":
                run: list[str] = []
                while i < len(messages) and messages[i].role == "tool":
                    if run:
                        starts.append(None)
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
        starts.append(len(units))
        if kept is not None:
            rendered = Rendered(header, messages, units, starts)
            kept[:] = [rendered, *(r for r in kept if not _extends(rendered, r))][:KEEP_RENDERED]
        return Rendering([*units, Unit(("\n" if units else "") + self.gen_text, "gen")])

    def units(self, conversation: Conversation) -> list[Unit]:
        return self.render(conversation).units

    @staticmethod
    def _reused(
        header: str | None, messages: tuple[Message, ...], first: int, kept: Sequence[Rendered]
    ) -> tuple[list[Unit], list[int | None]]:
        """Units and starts of the longest leading messages (past the system prompt, which is in the header)
        a kept rendering rendered; empty when none shares one."""
        best: tuple[Rendered, int] | None = None
        for rendered in kept:
            if rendered.header != header or _first(rendered.messages) != first:
                continue
            n, limit = first, min(len(rendered.messages), len(messages))
            while n < limit and rendered.messages[n] is messages[n]:
                n += 1
            # not inside a run of tool results (one unit), in this conversation or the kept one
            while n > first and (rendered.starts[n] is None or (
                    messages[n - 1].role == "tool" and n < len(messages) and messages[n].role == "tool")):
                n -= 1
            if n > first and (best is None or n > best[1]):
                best = (rendered, n)
        if best is None:
            return [], []
        rendered, n = best
        at = rendered.starts[n]
        assert at is not None
        return rendered.units[:at], rendered.starts[:n]


def _first(messages: tuple[Message, ...]) -> int:
    """Where the messages after the system prompt (rendered in the header) start."""
    return 1 if messages and messages[0].role == "system" else 0


def _extends(new: Rendered, old: Rendered) -> bool:
    """`new` renders every message of `old` (the same header, the same objects after the system prompt):
    `old` is not needed any more."""
    first = _first(new.messages)
    if new.header != old.header or _first(old.messages) != first or len(old.messages) > len(new.messages):
        return False
    return all(old.messages[i] is new.messages[i] for i in range(first, len(old.messages)))


def prompt_text(units: Sequence[Unit]) -> str:
    return "".join(u.text for u in units)
