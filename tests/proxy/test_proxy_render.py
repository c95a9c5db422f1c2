"""The native unit renderer is the chat template, byte for byte, and units encode like the whole text."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.model.tokenizer import build_tokenizer
from gyre.proxy.conversation import Conversation, Message, ToolCall, ToolSpec
from gyre.proxy.render import ChatMLRenderer, prompt_text
from gyre.proxy.tokens import TokenCodec

TOK = build_tokenizer()
CODEC = TokenCodec(TOK)
RENDERER = ChatMLRenderer()

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12) | st.sampled_from(
    ["", " ", "\n", "\n\n", "<tool_call>", "<|im_end|>", "é", " hello world", "\t{}"]
)
arguments = st.dictionaries(st.sampled_from(["path", "n", "ü"]), st.integers() | text, max_size=2)
calls = st.lists(
    st.builds(
        ToolCall,
        id=st.just("c1"),
        name=st.sampled_from(["read", "run"]),
        arguments=arguments | arguments.map(lambda a: __import__("json").dumps(a)),
    ),
    max_size=2,
)
message = st.one_of(
    st.builds(Message, role=st.just("user"), content=text),
    st.builds(Message, role=st.just("tool"), content=text),
    st.builds(Message, role=st.just("system"), content=text),
    st.builds(
        Message,
        role=st.just("assistant"),
        content=text,
        tool_calls=calls.map(tuple),
        reasoning=st.none() | text.filter(bool),
    ),
)
tools = st.lists(
    st.builds(
        ToolSpec,
        name=st.sampled_from(["read", "run"]),
        description=st.none() | text,
        parameters=st.just({"type": "object"}),
    ),
    max_size=2,
).map(tuple)


@settings(max_examples=150, deadline=None)
@given(st.lists(message, min_size=1, max_size=6), tools)
def test_units_equal_the_jinja_template(messages: list[Message], offered: tuple[ToolSpec, ...]) -> None:
    conversation = Conversation(tuple(messages), offered)
    units = RENDERER.units(conversation)
    expected = TOK.apply_chat_template(
        conversation.template_messages(),
        tools=[t.template_dict() for t in offered] or None,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt_text(units) == expected
    whole = CODEC.encode(expected)
    assert [i for u in units for i in CODEC.encode(u.text)] == whole
    assert units[-1].kind == "gen"
    for unit, following in itertools.pairwise(units):
        if following.kind == "body":
            assert unit.kind == "gen"
