"""Model output text -> what the harness sees: text and tool calls, incrementally.

The tiny model's template writes a tool call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
The parser is fed the cumulative decoded output (special tokens included) as it grows and returns the
pieces that have become certain. It holds back what may still change: an unclosed `<tool_call>`, a tail
that may be the start of a tag or of a stop sequence, and a trailing partial UTF-8 character. A tool call
whose JSON is malformed, or that is never closed, is returned as plain text — never an error.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gyre.proxy.conversation import ToolCall

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallPiece:
    call: ToolCall


Piece = TextPiece | ToolCallPiece


def new_tool_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def parse_tool_call(inner: str, make_id: Callable[[], str]) -> ToolCall | None:
    """The call inside one `<tool_call>` span, or None when it is not a well-formed call."""
    try:
        value = json.loads(inner)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    if set(value) - {"name", "arguments"}:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=make_id(), name=value["name"], arguments=arguments)


def _held_tail(text: str, prefixes: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `prefixes`."""
    best = 0
    for word in prefixes:
        for k in range(min(len(word) - 1, len(text)), best, -1):
            if text.endswith(word[:k]):
                best = k
                break
    return best


class OutputParser:
    """Incremental parser of one call's output; `feed` the cumulative visible text, get the new pieces."""

    def __init__(
        self,
        *,
        stop_strings: Sequence[str] = (),
        tool_calls: bool = True,
        make_id: Callable[[], str] = lambda: new_tool_id("call_"),
        call_separator: str = "",
    ) -> None:
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.tool_calls = tool_calls
        self.make_id = make_id
        self.call_separator = call_separator
        """What the chat template writes between a turn's text and a tool call (Qwen2.5: a newline). It is
        part of the call, not of the text, so the text echoed back renders to exactly what the model wrote."""
        self._done = 0
        opens = (call_separator + TOOL_OPEN, TOOL_OPEN) if call_separator else (TOOL_OPEN,)
        self._watch = (opens if tool_calls else ()) + self.stop_strings

    def feed(self, text: str, *, final: bool = False) -> list[Piece]:
        pieces: list[Piece] = []
        while True:
            pending = text[self._done :]
            if not pending:
                return pieces
            start = pending.find(TOOL_OPEN) if self.tool_calls else -1
            if start < 0:
                keep = len(pending) if final else self._certain(pending)
                if keep:
                    pieces.append(TextPiece(pending[:keep]))
                    self._done += keep
                return pieces
            if start:
                before = pending[:start]
                if self.call_separator and before.endswith(self.call_separator):
                    before = before[: len(before) - len(self.call_separator)]
                if before:
                    pieces.append(TextPiece(before))
                self._done += start
                continue
            close = pending.find(TOOL_CLOSE, len(TOOL_OPEN))
            if close < 0:
                if final:
                    pieces.append(TextPiece(pending))
                    self._done += len(pending)
                return pieces
            span = pending[: close + len(TOOL_CLOSE)]
            call = parse_tool_call(span[len(TOOL_OPEN) : close].strip(), self.make_id)
            pieces.append(ToolCallPiece(call) if call is not None else TextPiece(span))
            self._done += len(span)

    def _certain(self, pending: str) -> int:
        """How much of `pending` (no tool tag in it) can no longer change or turn into a tag or a stop."""
        end = len(pending)
        for stop in self.stop_strings:
            at = pending.find(stop)
            if at >= 0:
                end = min(end, at)
        while end and pending[end - 1] == "\ufffd":
            end -= 1
        return end - _held_tail(pending[:end], self._watch)


def visible_text(decoded: str, matched: int | str | None, last_token_text: str | None) -> str:
    """The output text without what stopped it: the stop token (when the last token is it) or the first
    occurrence of a matched stop string and everything after it."""
    if isinstance(matched, str):
        at = decoded.find(matched)
        return decoded[:at] if at >= 0 else decoded
    if matched is not None and last_token_text is not None and decoded.endswith(last_token_text):
        return decoded[: len(decoded) - len(last_token_text)]
    return decoded
