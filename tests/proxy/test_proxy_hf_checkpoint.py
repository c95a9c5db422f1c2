"""A Hugging Face-format checkpoint with its own BPE tokenizer and chat template, end to end: the engine
loads it, the proxy renders its template, tool calls round-trip through all three front ends, and the log's
ids are exactly what the engine saw and produced. Built in code (tests/hf_checkpoint.py), nothing downloaded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
from gyre.errors import ConfigError
from gyre.log import LogReader
from gyre.proxy import Proxy, ProxyConfig
from gyre.proxy.conversation import Conversation, Message, ToolCall, ToolSpec
from gyre.proxy.template_render import TemplateError, TemplateRenderer, renderer_for, template_messages
from gyre.proxy.tokens import TokenCodec
from gyre.sink import MemorySink
from tests.hf_checkpoint import save_checkpoint, train_tokenizer
from tests.proxy.proxy_helpers import TOKEN, capture
from tests.proxy.scripted_engine import ScriptedEngine
from tests.proxy.test_proxy_tito_log import REASSEMBLE

TOOL = {
    "name": "read_file",
    "description": "Read a file",
    "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
}
CALL_TEXT = '\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2-style")


@pytest.fixture(scope="module")
def codec(checkpoint: Path) -> TokenCodec:
    return TokenCodec.load(str(checkpoint))


@pytest.fixture(scope="module")
def hf_engine(checkpoint: Path) -> Iterator[LocalEngineServer]:
    server = LocalEngineServer(LocalEngine(LocalEngineConfig(model=str(checkpoint), seed=0)))
    server.start()
    yield server
    server.stop()


def _template(codec: TokenCodec, conversation: Conversation) -> str:
    return codec.tokenizer.apply_chat_template(
        template_messages(conversation),
        tools=[t.template_dict() for t in conversation.tools] or None,
        tokenize=False,
        add_generation_prompt=True,
    )


text = st.sampled_from(["", "hi", "Let me look.", " two words", "é ü", "{}", "line\nbreak", "print(1)"])
message = st.one_of(
    st.builds(Message, role=st.sampled_from(["user", "tool", "system"]), content=text),
    st.builds(
        Message,
        role=st.just("assistant"),
        content=text,
        tool_calls=st.lists(
            st.builds(ToolCall, id=st.just("c"), name=st.sampled_from(["read", "run"]), arguments=st.just({"p": 1})),
            max_size=2,
        ).map(tuple),
    ),
)


@settings(max_examples=60, deadline=None)
@given(messages=st.lists(message, min_size=1, max_size=6), tools=st.booleans())
def test_units_are_the_checkpoint_template(codec: TokenCodec, messages: list[Message], tools: bool) -> None:
    offered = (ToolSpec("read", "Read", {"type": "object"}),) if tools else ()
    conversation = Conversation((Message("user", "task"), *messages), offered)
    renderer = renderer_for(codec.tokenizer, codec.stop_texts)
    assert isinstance(renderer, TemplateRenderer)
    rendering = renderer.render(conversation)
    assert "".join(u.text for u in rendering.units) == _template(codec, conversation)
    assert rendering.rewritten == 0 and rendering.units[-1].kind == "gen"
    for i, unit in enumerate(rendering.units):
        if unit.kind == "body":
            assert rendering.units[i - 1].kind == "gen" and unit.text.endswith("<|im_end|>")
            assistant = [m for m in conversation.messages if m.role == "assistant"][
                sum(1 for u in rendering.units[:i] if u.kind == "body")
            ]
            assert renderer.assistant_body(assistant) == unit.text  # the reply node's key is what renders


def test_context_units_encode_like_the_whole_prompt(codec: TokenCodec) -> None:
    conversation = Conversation(
        (
            Message("system", "Be brief."),
            Message("user", "What is in a.py?"),
            Message("assistant", "Let me look.", (ToolCall("c", "read_file", {"path": "a.py"}),)),
            Message("tool", "print(1)"),
            Message("tool", "print(2)"),
            Message("assistant", "It prints."),
            Message("user", "Thanks, done."),
        ),
        (ToolSpec("read_file", "Read a file", {"type": "object"}),),
    )
    units = renderer_for(codec.tokenizer).render(conversation).units
    assert [i for u in units for i in codec.encode(u.text)] == codec.encode(_template(codec, conversation))
    assert len(units) >= 9  # cut at every message: the trie can match turn by turn


def _scripted(codec: TokenCodec) -> ScriptedEngine:
    return ScriptedEngine(codec.tokenizer, codec.tokenizer.convert_tokens_to_ids("<|im_end|>"))


def test_tool_conversation_round_trips_exactly_through_three_apis(codec: TokenCodec, checkpoint: Path, start_proxy):
    engine = _scripted(codec)
    engine.start()
    try:
        p = start_proxy({"cell0": engine.url}, tokenizer=str(checkpoint))
        assert isinstance(p.proxy.renderer, TemplateRenderer) and p.proxy.renderer.tool_call_separator == "\n"
        # the model writes the template's layout: a call after text on a new line, a call alone right away
        alone = CALL_TEXT.lstrip("\n")
        engine.say("Let me look." + CALL_TEXT, "Now the other one." + CALL_TEXT, alone, "Both print 1.")
        an = anthropic.Anthropic(base_url=p.url, auth_token=TOKEN, max_retries=0, timeout=30)
        oa = openai.OpenAI(base_url=f"{p.url}/v1", api_key=TOKEN, max_retries=0, timeout=30)
        # 1: Anthropic, streamed
        history: list = [{"role": "user", "content": "What do a.py and b.py print?"}]
        with an.messages.stream(model="m", max_tokens=100, tools=[TOOL], messages=history) as s:
            first = s.get_final_message()
        assert [b.type for b in first.content] == ["text", "tool_use"] and first.content[0].text == "Let me look."
        use = first.content[1]
        # 2: OpenAI chat, with the Anthropic turn translated into OpenAI messages
        chat = [
            {"role": "user", "content": history[0]["content"]},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "print(1)"},
        ]
        tools_oa = [{"type": "function", "function": {"name": "read_file", "parameters": TOOL["input_schema"]}}]
        tools_oa[0]["function"]["description"] = TOOL["description"]
        second = oa.chat.completions.create(model="m", messages=chat, tools=tools_oa, max_tokens=100)
        message = second.choices[0].message
        assert message.content == "Now the other one." and message.tool_calls[0].function.name == "read_file"
        # 3 and 4: the Responses API, the history as items
        tools_rs = [{"type": "function", **{k: v for k, v in tools_oa[0]["function"].items()}}]
        items: list = [
            {"role": "user", "content": history[0]["content"]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
            {"type": "function_call", "call_id": use.id, "name": use.name, "arguments": json.dumps(use.input)},
            {"type": "function_call_output", "call_id": use.id, "output": "print(1)"},
            {"role": "assistant", "content": message.content},
            *(
                {"type": "function_call", "call_id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                for c in message.tool_calls
            ),
            {"type": "function_call_output", "call_id": message.tool_calls[0].id, "output": "print(1)"},
        ]
        third = oa.responses.create(model="m", input=items, tools=tools_rs, stream=False, max_output_tokens=100)
        assert [i.type for i in third.output] == ["function_call"]
        items += [i.model_dump(exclude_none=True) for i in third.output]
        items.append({"type": "function_call_output", "call_id": third.output[0].call_id, "output": "print(1)"})
        fourth = oa.responses.create(model="m", input=items, tools=tools_rs, max_output_tokens=100)
        assert fourth.output_text == "Both print 1."
    finally:
        engine.stop()
    calls = p.events("model_call_finished")
    assert len(calls) == 4
    for before, after, sent_before, sent_after in zip(
        calls, calls[1:], engine.requests, engine.requests[1:], strict=False
    ):
        assert after.parent_call_id == before.call_id and after.drift_tokens == 0
        full = sent_before["input_ids"] + before.output_ids
        assert after.prefix_len == len(full) and sent_after["input_ids"][: len(full)] == full
    assert codec.decode(engine.requests[0]["input_ids"]).startswith("<|im_start|>system\nYou are a careful coding")


def test_real_engine_serves_the_checkpoint_and_the_log_is_exact(
    hf_engine: LocalEngineServer, checkpoint: Path, codec: TokenCodec, start_proxy, monkeypatch
) -> None:
    seen: dict = {}
    capture(hf_engine, monkeypatch, seen)
    p = start_proxy({"cell0": hf_engine.url}, tokenizer=str(checkpoint), log=True)
    an = anthropic.Anthropic(base_url=p.url, auth_token=TOKEN, max_retries=0, timeout=60)
    oa = openai.OpenAI(base_url=f"{p.url}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    history: list[tuple[str, str]] = []
    for turn in range(6):
        history.append(("user", f"step {turn}: run the tests"))
        if turn % 3 == 0:
            reply = oa.chat.completions.create(
                model="m", max_tokens=5, seed=turn, messages=[{"role": r, "content": t} for r, t in history]
            )
            said = reply.choices[0].message.content or ""
        elif turn % 3 == 1:
            message = an.messages.create(
                model="m", max_tokens=5, messages=[{"role": r, "content": t} for r, t in history]
            )
            said = "".join(b.text for b in message.content if b.type == "text")
        else:
            said = oa.responses.create(
                model="m", max_output_tokens=5, input=[{"role": r, "content": t} for r, t in history]
            ).output_text
        history.append(("assistant", said))
    p.server.stop()
    p.sink.close()
    rows = LogReader(p.log_dir).duckdb().execute(REASSEMBLE).fetchall()
    assert len(rows) == 6
    for index, (call_id, prompt, output, logprobs, _parent, _drift) in enumerate(rows):
        engine = seen[f"{call_id}#0"]
        assert prompt == engine.input_ids and output == engine.output_ids, f"turn {index}"
        assert [round(x, 4) for x in logprobs] == [round(x, 4) for x in engine.output_logprobs]
    first_prompt = codec.decode(rows[0][1])
    assert first_prompt.startswith("<|im_start|>system\nYou are a careful coding agent.<|im_end|>")
    assert max(max(r[1]) for r in rows) >= 256  # BPE merges in use: not the byte-level tiny vocabulary


def test_a_template_that_rewrites_history_says_so(codec: TokenCodec, tmp_path: Path, start_proxy) -> None:
    checkpoint = save_checkpoint(tmp_path / "think", "think_dropping")
    engine = _scripted(codec)
    engine.start()
    try:
        p = start_proxy({"cell0": engine.url}, tokenizer=str(checkpoint))
        engine.say("<think>\nplan it\n</think>\n\nHello.", "Bye.")
        oa = openai.OpenAI(base_url=f"{p.url}/v1", api_key=TOKEN, max_retries=0, timeout=30)
        history: list = [{"role": "user", "content": "hi"}]
        first = oa.chat.completions.create(model="m", messages=history, max_tokens=50)
        history.append({"role": "assistant", "content": first.choices[0].message.content})
        history.append({"role": "user", "content": "bye"})
        oa.chat.completions.create(model="m", messages=history, max_tokens=50)
    finally:
        engine.stop()
    started = p.events("model_call_started")
    assert [e.rerendered_turns for e in started] == [0, 1]
    calls = p.events("model_call_finished")
    # the recorded <think> output is not reused: the second prompt branches off before it, with exact ids
    assert calls[1].drift_tokens == len(calls[0].output_ids)
    assert engine.requests[1]["input_ids"][: calls[1].prefix_len] == engine.requests[0]["input_ids"]
    assert "plan it" not in codec.decode(engine.requests[1]["input_ids"])


def test_unsuitable_checkpoints_are_refused_at_start(codec: TokenCodec, tmp_path: Path) -> None:
    no_tools = save_checkpoint(tmp_path / "no-tools")
    tokenizer = train_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer.save_pretrained(no_tools)
    with pytest.raises(TemplateError, match="does not list the tools"):
        Proxy(ProxyConfig(engines={"c": "http://127.0.0.1:9"}, tokenizer=str(no_tools)), sink=MemorySink())
    small = save_checkpoint(tmp_path / "small-vocab", model_vocab=300)
    with pytest.raises(ConfigError, match="would index past the embedding"):
        TokenCodec.load(str(small))
    with pytest.raises(ConfigError, match="would index past the embedding"):
        LocalEngine(LocalEngineConfig(model=str(small)))


@pytest.mark.parametrize("template", ["qwen2_style", "think_dropping"])
def test_remembered_prefixes_render_like_a_fresh_renderer(tmp_path: Path, template: str) -> None:
    tokenizer = TokenCodec.load(str(save_checkpoint(tmp_path / template, template))).tokenizer
    remembering, fresh = TemplateRenderer(tokenizer), TemplateRenderer(tokenizer)
    messages: list[Message] = [Message("user", "task")]
    for i in range(6):
        call = (ToolCall("c", "read", {"p": i}),) if i % 2 else ()
        messages.append(Message("assistant", f"<think>\nstep {i}\n</think>\n\nok {i}", call))
        messages.append(Message("tool" if call else "user", f"result {i}"))
        conversation = Conversation(tuple(messages), (ToolSpec("read", None, {}),))
        fresh._memo.clear()
        assert remembering.render(conversation) == fresh.render(conversation)
    if template == "think_dropping":
        assert fresh.render(conversation).rewritten > 0
