"""Output parsing: tool calls, malformed tool JSON as text, hold-backs while streaming, stop trimming."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.proxy.output import OutputParser, TextPiece, ToolCallPiece, visible_text

CALL = '<tool_call>{"name": "run", "arguments": {"cmd": "ls"}}</tool_call>'


def _ids() -> object:
    n = iter(range(1000))
    return lambda: f"id{next(n)}"


def _flatten(pieces: list) -> list:
    """Adjacent text pieces merged, so chunkings can be compared."""
    out: list = []
    for piece in pieces:
        if isinstance(piece, TextPiece) and out and isinstance(out[-1], TextPiece):
            out[-1] = TextPiece(out[-1].text + piece.text)
        else:
            out.append(piece)
    return out


def test_tool_calls_and_text() -> None:
    pieces = OutputParser(make_id=_ids()).feed("Sure." + CALL + "\n" + CALL.replace("ls", "pwd"), final=True)
    assert [type(p) for p in pieces] == [TextPiece, ToolCallPiece, TextPiece, ToolCallPiece]
    assert pieces[1].call.name == "run" and pieces[1].call.arguments == {"cmd": "ls"}
    assert pieces[3].call.id == "id1"


def test_malformed_or_unclosed_tool_calls_are_text() -> None:
    for bad in (
        '<tool_call>{"name": "run", "arguments": {cmd}}</tool_call>',
        '<tool_call>["run"]</tool_call>',
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "run", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "run", "arguments": {}, "extra": 1}</tool_call>',
        '<tool_call>{"name": "run", "arguments": {"cmd": "l',
    ):
        assert OutputParser().feed("a" + bad, final=True) == [TextPiece("a"), TextPiece(bad)]
    string_args = '<tool_call>{"name": "run", "arguments": "{\\"cmd\\": \\"ls\\"}"}</tool_call>'
    (piece,) = OutputParser().feed(string_args, final=True)
    assert isinstance(piece, ToolCallPiece) and piece.call.arguments == {"cmd": "ls"}


def test_streaming_holds_back_what_may_change() -> None:
    parser = OutputParser(stop_strings=("STOP",))
    assert parser.feed("abc<tool") == [TextPiece("abc")]
    assert parser.feed('abc<tool_call>{"name"') == []
    call, text = parser.feed('abc<tool_call>{"name": "run"}</tool_call>x ST')
    assert isinstance(call, ToolCallPiece) and call.call.name == "run" and text == TextPiece("x ")
    assert parser.feed('abc<tool_call>{"name": "run"}</tool_call>x STO\ufffd') == []
    assert parser.feed('abc<tool_call>{"name": "run"}</tool_call>x STOP', final=False) == []
    assert parser.feed('abc<tool_call>{"name": "run"}</tool_call>x ', final=True) == []


def test_visible_text_trims_what_stopped_the_output() -> None:
    assert visible_text("hello STOP more", "STOP", None) == "hello "
    assert visible_text("hello<|im_end|>", 258, "<|im_end|>") == "hello"
    assert visible_text("hello", None, None) == "hello"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            ["a", " ", "<tool_call>", "</tool_call>", CALL, '{"name": "x"}', "S", "TOP", "\ufffd", "é", "<tool"]
        ),
        max_size=10,
    ),
    st.lists(st.integers(0, 200), max_size=6),
)
def test_any_chunking_gives_the_same_pieces(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    whole = OutputParser(stop_strings=("STOP",), make_id=_ids()).feed(text, final=True)
    parser = OutputParser(stop_strings=("STOP",), make_id=_ids())
    pieces: list = []
    for cut in sorted(c for c in cuts if c < len(text)):
        pieces += parser.feed(text[:cut])
    pieces += parser.feed(text, final=True)
    assert _flatten(pieces) == _flatten(whole)
