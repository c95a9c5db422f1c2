"""Turning a call's output into the assistant turn both APIs return, and back into the reply record.

`Reply` accumulates parser pieces into content blocks and produces, as it goes, the Anthropic stream events
for them. Whitespace-only text between tool calls is dropped (Anthropic rejects whitespace-only text
blocks); a stream opens a text block only once it has non-blank text, so streamed and unstreamed replies
carry the same blocks. `message()` is the turn as the harness was shown it — what the proxy indexes so
that its echo is recognised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gyre.engine import FinishReason
from gyre.proxy.conversation import Message, ToolCall, tojson
from gyre.proxy.output import OutputParser, Piece, TextPiece, new_tool_id, visible_text
from gyre.proxy.tokens import TokenCodec

Event = tuple[str, dict[str, Any]]


@dataclass(frozen=True, slots=True)
class FinalText:
    text: str
    stop_sequence: str | None


def final_text(codec: TokenCodec, output_ids: list[int], finish: FinishReason) -> FinalText:
    """The output's text without what stopped it: a matched stop string (and what follows), or the stop
    token it ended with."""
    decoded = codec.decode(output_ids)
    matched = finish.matched if finish.type == "stop" else None
    if isinstance(matched, str):
        return FinalText(visible_text(decoded, matched, None), matched)
    last = output_ids[-1] if output_ids else None
    if finish.type == "stop" and last is not None and (last == matched or last in codec.special_ids):
        return FinalText(visible_text(decoded, last, codec.token_text(last)), None)
    return FinalText(decoded, None)


class Reply:
    """Content blocks of one reply, built from pieces; `add` returns Anthropic stream events."""

    def __init__(self, *, keep_blank_text: bool = False) -> None:
        self.keep_blank_text = keep_blank_text
        self.blocks: list[dict[str, Any]] = []
        self.calls: list[ToolCall] = []
        self.texts: list[str] = []
        self._open = False
        self._blank = ""

    def add(self, pieces: list[Piece]) -> list[Event]:
        events: list[Event] = []
        for piece in pieces:
            if isinstance(piece, TextPiece):
                events += self._text(piece.text)
            else:
                events += self._tool(piece.call)
        return events

    def close(self) -> list[Event]:
        events = self._end_text()
        if self.keep_blank_text and self._blank:
            self.texts.append(self._blank)
        self._blank = ""
        return events

    def _text(self, text: str) -> list[Event]:
        if not text:
            return []
        if self._open:
            self.blocks[-1]["text"] += text
            self.texts.append(text)
            return [_delta(len(self.blocks) - 1, {"type": "text_delta", "text": text})]
        pending = self._blank + text
        if not pending.strip():
            self._blank = pending
            return []
        self._blank = ""
        self._open = True
        self.blocks.append({"type": "text", "text": pending})
        self.texts.append(pending)
        index = len(self.blocks) - 1
        return [
            (
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
            ),
            _delta(index, {"type": "text_delta", "text": pending}),
        ]

    def _end_text(self) -> list[Event]:
        if not self._open:
            return []
        self._open = False
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]

    def _tool(self, call: ToolCall) -> list[Event]:
        events = self._end_text()
        if self.keep_blank_text and self._blank:
            self.texts.append(self._blank)
        self._blank = ""
        arguments = call.arguments_object()
        self.calls.append(call)
        self.blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": arguments})
        index = len(self.blocks) - 1
        start = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
        events.append(("content_block_start", {"type": "content_block_start", "index": index, "content_block": start}))
        events.append(
            _delta(index, {"type": "input_json_delta", "partial_json": tojson(arguments)})
        )
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        return events

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def message(self) -> Message:
        return Message("assistant", self.text, tuple(self.calls))


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def new_parser(stop: tuple[str, ...], tools: bool, id_prefix: str, call_separator: str = "") -> OutputParser:
    return OutputParser(
        stop_strings=stop, tool_calls=tools, make_id=lambda: new_tool_id(id_prefix), call_separator=call_separator
    )
