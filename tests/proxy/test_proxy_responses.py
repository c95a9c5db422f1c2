"""`POST /v1/responses` through the official `openai` SDK: text, function tools, streaming, token-exact echo."""

from __future__ import annotations

import json

import openai
import pytest

from tests.proxy.proxy_helpers import TOKEN

TOOLS = [
    {
        "type": "function",
        "name": "read_file",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
]
TOOL_CALL = '<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}}</tool_call>'


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=30)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_round_trip(scripted, start_proxy, stream: bool) -> None:
    p = start_proxy({"cell0": scripted.url})
    client = _client(p.url)
    scripted.say("Let me look." + TOOL_CALL, "It prints 1.")
    history: list = [{"role": "user", "content": "What is in a.py?"}]
    kwargs = {"model": "m", "instructions": "Be brief.", "tools": TOOLS, "max_output_tokens": 200}
    if stream:
        events = list(client.responses.create(input=history, stream=True, **kwargs))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.output_text.delta" in kinds and "response.function_call_arguments.done" in kinds
        assert [e.sequence_number for e in events] == list(range(len(events)))
        first = events[-1].response
    else:
        first = client.responses.create(input=history, **kwargs)
    assert first.status == "completed" and first.output_text == "Let me look."
    assert [item.type for item in first.output] == ["message", "function_call"]
    call = first.output[1]
    assert call.name == "read_file" and json.loads(call.arguments) == {"path": "a.py"}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens == len(
        p.events("model_call_finished")[0].output_ids
    )
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "print(1)"})
    second = client.responses.create(input=history, **kwargs)
    assert second.output_text == "It prints 1." and [i.type for i in second.output] == ["message"]
    calls = p.events("model_call_finished")
    first_full = scripted.requests[0]["input_ids"] + calls[0].output_ids
    assert scripted.requests[1]["input_ids"][: len(first_full)] == first_full  # the echo reused the exact ids
    assert calls[1].parent_call_id == calls[0].call_id and calls[1].drift_tokens == 0


def test_responses_max_output_tokens_is_incomplete(scripted, start_proxy) -> None:
    p = start_proxy({"cell0": scripted.url})
    scripted.say("a long answer that goes on", eos=False)
    reply = _client(p.url).responses.create(model="m", input="hi", max_output_tokens=5)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "computer"}]}, "tools.0.type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.id"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
    ],
)
def test_responses_unsupported_is_a_400_naming_the_field(scripted, start_proxy, extra: dict, param: str) -> None:
    p = start_proxy({"cell0": scripted.url})
    body = {"model": "m", "input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        _client(p.url).post("/responses", body=body, cast_to=object)
    assert info.value.body["param"] == param
    assert p.events("model_call_started") == []
