"""The official Anthropic and OpenAI SDKs against the proxy on loopback, streamed and not."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from gyre.model.tokenizer import build_tokenizer
from tests.proxy.proxy_helpers import TOKEN

TOOLS_ANTHROPIC = [
    {
        "name": "read_file",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]
TOOLS_OPENAI = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": TOOLS_ANTHROPIC[0]["input_schema"],
        },
    }
]
TOOL_CALL = '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=30)


def _anthropic(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, auth_token=TOKEN, max_retries=0, timeout=30)


def test_openai_plain_and_streamed(engine_server, start_proxy) -> None:
    p = start_proxy({"cell0": engine_server.url})
    client = _openai(p.url)
    assert [m.id for m in client.models.list()] == ["gyre-policy"]
    first = client.chat.completions.create(
        model="policy",
        max_tokens=6,
        temperature=1.0,
        seed=3,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        logprobs=True,
    )
    choice = first.choices[0]
    assert first.model == "policy" and choice.finish_reason in ("stop", "length")
    assert first.usage.completion_tokens <= 6 and first.usage.prompt_tokens > 0
    assert choice.logprobs is not None and all(t.logprob <= 0 for t in choice.logprobs.content)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": choice.message.content},
        {"role": "user", "content": "again"},
    ]
    stream = client.chat.completions.create(
        model="policy", max_tokens=6, messages=history, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 6
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    finished = p.events("model_call_finished")
    assert len(finished) == 2
    assert finished[1].parent_call_id == finished[0].call_id  # the echo extended the first call
    assert (
        finished[1].prefix_len
        == len(finished[0].prompt_delta_ids) + len(finished[0].output_ids) - finished[1].drift_tokens
    )
    assert finished[1].cached_tokens > 0  # the engine reused the first call's KV
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == build_tokenizer().decode(
        finished[1].output_ids[:-1] if finished[1].finish_reason == "stop" else finished[1].output_ids
    )


def test_anthropic_plain_streamed_and_count_tokens(engine_server, start_proxy) -> None:
    p = start_proxy({"cell0": engine_server.url})
    client = _anthropic(p.url)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    counted = client.messages.count_tokens(model="claude", system="You are terse.", messages=messages)
    message = client.messages.create(model="claude", max_tokens=5, system="You are terse.", messages=messages)
    assert message.type == "message" and message.role == "assistant" and message.model == "claude"
    assert message.usage.input_tokens == counted.input_tokens
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens <= 5
    with client.messages.stream(model="claude", max_tokens=5, system="You are terse.", messages=messages) as s:
        kinds = [event.type for event in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [e.branch for e in p.events("model_call_finished")] == ["main", "main"]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_use_round_trip(scripted, start_proxy, stream: bool) -> None:
    p = start_proxy({"cell0": scripted.url})
    client = _anthropic(p.url)
    scripted.say("Let me look." + TOOL_CALL, "It is empty.")
    messages: list = [{"role": "user", "content": "What is in a.py?"}]
    kwargs = {"model": "claude", "max_tokens": 200, "tools": TOOLS_ANTHROPIC, "messages": messages}
    if stream:
        with client.messages.stream(**kwargs) as s:
            first = s.get_final_message()
    else:
        first = client.messages.create(**kwargs)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    use = first.content[1]
    assert use.name == "read_file" and use.input == {"path": "a.py"} and use.id.startswith("toolu_")
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "(empty)"}]},
    ]
    second = client.messages.create(model="claude", max_tokens=200, tools=TOOLS_ANTHROPIC, messages=messages)
    assert second.content[0].text == "It is empty." and second.stop_reason == "end_turn"
    sent = [r["input_ids"] for r in scripted.requests]
    calls = p.events("model_call_finished")
    first_full = sent[0] + calls[0].output_ids
    assert sent[1][: len(first_full)] == first_full  # token-exact extension: the output was not re-tokenized
    assert calls[1].parent_call_id == calls[0].call_id and calls[1].prefix_len == len(first_full)
    assert calls[1].drift_tokens == 0
    tok = build_tokenizer()
    assert "# Tools" in tok.decode(sent[0]) and "<tool_response>\n(empty)\n</tool_response>" in tok.decode(sent[1])
    assert calls[0].policy_version == 7  # the engine's weight_version


@pytest.mark.parametrize("stream", [False, True])
def test_openai_tool_calls_round_trip(scripted, start_proxy, stream: bool) -> None:
    p = start_proxy({"cell0": scripted.url})
    client = _openai(p.url)
    scripted.say(TOOL_CALL, "Done.")
    messages: list = [{"role": "user", "content": "Read a.py"}]
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="m", messages=messages, tools=TOOLS_OPENAI, max_tokens=200, stream=True
            )
        )
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert len(deltas) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"
        call_id, name, arguments = deltas[0].id, deltas[0].function.name, deltas[0].function.arguments
    else:
        reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS_OPENAI, max_tokens=200)
        assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
        tool_call = reply.choices[0].message.tool_calls[0]
        call_id, name, arguments = tool_call.id, tool_call.function.name, tool_call.function.arguments
    assert name == "read_file" and json.loads(arguments) == {"path": "a.py"}
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "print(1)"},
    ]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS_OPENAI, max_tokens=200)
    assert second.choices[0].message.content == "Done."
    calls = p.events("model_call_finished")
    assert calls[1].parent_call_id == calls[0].call_id and calls[1].drift_tokens == 0
    first_full = scripted.requests[0]["input_ids"] + calls[0].output_ids
    assert scripted.requests[1]["input_ids"][: len(first_full)] == first_full


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_tool_json_comes_back_as_text(scripted, start_proxy, stream: bool) -> None:
    p = start_proxy({"cell0": scripted.url})
    bad = '<tool_call>{"name": "read_file", "arguments": {path: a.py}</tool_call>'
    scripted.say("x" + bad)
    client = _anthropic(p.url)
    kwargs = {
        "model": "c",
        "max_tokens": 200,
        "tools": TOOLS_ANTHROPIC,
        "messages": [{"role": "user", "content": "go"}],
    }
    if stream:
        with client.messages.stream(**kwargs) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kwargs)
    assert message.stop_reason == "end_turn"
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == "x" + bad
