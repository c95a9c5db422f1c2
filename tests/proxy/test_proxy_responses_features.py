"""`POST /v1/responses`: the rule of every request feature current harnesses send (docs/proxy.md, "Responses:
the rule per feature"). Each is rendered into the prompt (checked on the ids the engine received), answered by
the proxy, or refused with a typed 400 naming the field; a call the model writes comes back as the item of
the tool's kind, and its echo renders to exactly what the model wrote (no drift)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.proxy.proxy_helpers import TOKEN, Running
from tests.proxy.scripted_engine import ScriptedEngine, tool_call

FUNCTION = {"type": "function", "name": "read_file", "description": "Read a file", "strict": False,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.",
             "tools": [{"type": "function", "name": "wait_agent", "description": "Wait for agents.",
                        "parameters": {"type": "object", "properties": {"targets": {"type": "array"}}}}]}
PATCH_GRAMMAR = 'start: "*** Begin Patch" LF hunk+ "*** End Patch"'
CUSTOM = {"type": "custom", "name": "apply_patch", "description": "Edit files. A FREEFORM tool.",
          "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
LOCAL_SHELL = {"type": "local_shell"}
HOSTED = [{"type": "web_search", "external_web_access": False},
          {"type": "mcp", "server_label": "deepwiki", "server_url": "https://example.invalid/mcp"}]


def post(p: Running, body: dict[str, Any], token: str = TOKEN) -> httpx.Response:
    return httpx.post(f"{p.url}/v1/responses", json=body, headers={"authorization": f"Bearer {token}"}, timeout=30)


def stream_events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]


def answer(p: Running, body: dict[str, Any]) -> dict[str, Any]:
    """The response object, plain or (body["stream"]) the streamed `response.completed`'s."""
    response = post(p, body)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        return response.json()
    events = stream_events(response)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = {e["item"]["id"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and {i["id"]: i for i in final["output"]} == done
    final["_events"] = [e["type"] for e in events]
    return final


def prompt_of(scripted: ScriptedEngine, n: int = -1) -> str:
    return scripted.tokenizer.decode(scripted.requests[n]["input_ids"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("tool", "written", "check"),
    [
        (NAMESPACE, tool_call("multi_agent_v1.wait_agent", {"targets": ["a"]}),
         lambda i: i["type"] == "function_call" and i["name"] == "wait_agent" and i["namespace"] == "multi_agent_v1"
         and json.loads(i["arguments"]) == {"targets": ["a"]}),
        (CUSTOM, tool_call("apply_patch", {"input": "*** Begin Patch\n*** End Patch"}),
         lambda i: i["type"] == "custom_tool_call" and i["name"] == "apply_patch"
         and i["input"] == "*** Begin Patch\n*** End Patch"),
        (LOCAL_SHELL, tool_call("local_shell", {"command": ["ls", "-a"], "workdir": "/w"}),
         lambda i: i["type"] == "local_shell_call" and i["action"]["type"] == "exec"
         and i["action"]["command"] == ["ls", "-a"] and i["action"]["working_directory"] == "/w"),
    ],
    ids=["namespace", "custom", "local_shell"],
)
def test_tool_kinds_are_rendered_and_their_calls_map_back(scripted, start_proxy, tool, written, check,
                                                          stream: bool) -> None:
    p = start_proxy({"cell0": scripted.url})
    scripted.say("On it." + written, "Done.")
    body = {"model": "m", "instructions": "Be brief.", "tools": [FUNCTION, tool], "stream": stream,
            "input": [{"role": "user", "content": "Go."}]}
    first = answer(p, body)
    prompt = prompt_of(scripted)
    assert '"read_file"' in prompt  # function tools as they are
    rendered = {"namespace": '"multi_agent_v1.wait_agent"', "custom": PATCH_GRAMMAR.replace('"', '\\"'),
                "local_shell": '"local_shell"'}[tool.get("type") if tool["type"] != "namespace" else "namespace"]
    assert rendered in prompt, prompt
    message, call = first["output"]
    assert message["type"] == "message" and check(call), call
    if stream and call["type"] == "custom_tool_call":
        assert "response.custom_tool_call_input.done" in first["_events"]
    outputs = {"function_call": "function_call_output", "custom_tool_call": "custom_tool_call_output",
               "local_shell_call": "local_shell_call_output"}
    echo = {k: v for k, v in call.items() if k != "status"}
    body["input"] = [*body["input"], message, echo, {"type": outputs[call["type"]], "call_id": call["call_id"],
                                                     "output": "ok"}]
    second = answer(p, body)
    assert second["output"][0]["content"][0]["text"] == "Done."
    started, finished = p.events("model_call_started"), p.events("model_call_finished")
    assert finished[1].parent_call_id == finished[0].call_id and finished[1].drift_tokens == 0  # exact echo
    assert started[1].dropped_tools == []


def test_hosted_tools_are_left_out_and_recorded(scripted, start_proxy) -> None:
    p = start_proxy({"cell0": scripted.url})
    scripted.say("hi")
    answer(p, {"model": "m", "input": "hi", "tools": [*HOSTED, FUNCTION]})
    [started] = p.events("model_call_started")
    assert started.dropped_tools == ["web_search", "mcp:deepwiki"]
    prompt = prompt_of(scripted)
    assert "read_file" in prompt and "web_search" not in prompt and "deepwiki" not in prompt


def test_developer_messages_and_reasoning_items_are_rendered(scripted, start_proxy) -> None:
    p = start_proxy({"cell0": scripted.url})
    scripted.say("a", "b")
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Think: plan"}],
                 "encrypted_content": "opaque"}
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Dev rules."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Q1"}]},
             reasoning,
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A1"}]},
             {"type": "message", "role": "user", "content": "Q2"}]
    answer(p, {"model": "m", "input": items, "include": ["reasoning.encrypted_content"]})
    prompt = prompt_of(scripted)
    assert "<|im_start|>system\nDev rules.<|im_end|>" in prompt
    assert "Think: plan" in prompt and prompt.index("Think: plan") < prompt.index("A1")
    # encrypted reasoning alone is another model's opaque state: nothing to render, the same prompt as without it
    opaque = {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "opaque"}
    answer(p, {"model": "m", "input": [*items[:2], opaque, *items[3:]]})
    answer_without = prompt_of(scripted)
    assert "opaque" not in answer_without and "Think" not in answer_without


def test_answered_fields_are_accepted_and_echoed(scripted, start_proxy) -> None:
    """What Codex CLI sends besides tools and input; none of it changes the prompt."""
    p = start_proxy({"cell0": scripted.url})
    scripted.say("x", "x")
    plain = {"model": "m", "input": "hi"}
    answer(p, plain)
    extras = {"parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
              "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread-1",
              "client_metadata": {"turn_id": "t"}, "text": {"verbosity": "low"}, "truncation": "disabled",
              "service_tier": "auto", "user": "u", "safety_identifier": "s", "metadata": {"k": "v"},
              "stream_options": {"include_obfuscation": False}, "max_tool_calls": 3}
    reply = answer(p, {**plain, **extras})
    assert scripted.requests[0]["input_ids"] == scripted.requests[1]["input_ids"]
    assert reply["prompt_cache_key"] == "thread-1" and reply["store"] is False
    assert reply["parallel_tool_calls"] is False and reply["reasoning"]["effort"] == "medium"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"reasoning": {"effort": "low", "extra": 1}}, "reasoning.extra"),
        ({"include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}, "include.1"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format.type"),
        ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice.type"),
        ({"tools": [{"type": "apply_patch"}]}, "tools.0.type"),
        ({"tools": [{"type": "custom", "name": "p", "format": {"type": "regex"}}]}, "tools.0.format"),
        ({"tools": [{**NAMESPACE, "tools": [CUSTOM]}]}, "tools.0.tools.0.type"),
        ({"tools": [FUNCTION, FUNCTION]}, "tools.1.name"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.id"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"type": "function_call_output", "call_id": "c",
                     "output": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.output.0.type"),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p"}]}, "input.0.input"),
        ({"input": [{"type": "local_shell_call", "call_id": "c", "action": {}}]}, "input.0.action"),
        ({"input": [{"type": "reasoning", "summary": [{"type": "x"}]}]}, "input.0.summary.0"),
    ],
)
def test_refused_features_are_a_400_naming_the_field(scripted, start_proxy, extra: dict, param: str) -> None:
    p = start_proxy({"cell0": scripted.url})
    response = post(p, {"model": "m", "input": "hi", **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert p.events("model_call_started") == []


@pytest.mark.parametrize("stream", [False, True])
def test_previous_response_id_continues_with_the_same_tree(scripted, start_proxy, stream: bool) -> None:
    """A conversation chained by `previous_response_id` (and an `item_reference`) renders the same prompts
    and builds the same call tree as the same conversation sent whole with `store: false`."""
    p = start_proxy({"cell0": scripted.url})
    other = "other-token-0123456789abcdef"
    p.server.register_execution("exec-2", other)
    written = "Look." + tool_call("read_file", {"path": "a.py"})
    scripted.say(written, "It prints 1.", written, "It prints 1.")
    base = {"model": "m", "instructions": "Be brief.", "tools": [FUNCTION], "stream": stream}
    question = [{"role": "user", "content": "What is in a.py?"}]

    whole = answer(p, {**base, "store": False, "input": question})
    call = whole["output"][1]
    answer(p, {**base, "store": False, "input": [*question, *whole["output"],
                                                 {"type": "function_call_output", "call_id": call["call_id"],
                                                  "output": "print(1)"}]})

    def answer_other(body: dict[str, Any]) -> dict[str, Any]:
        response = post(p, body, other)
        assert response.status_code == 200, response.text
        return stream_events(response)[-1]["response"] if stream else response.json()

    first = answer_other({**base, "input": question})
    assert first["store"] is True
    call = first["output"][1]
    second = answer_other({**base, "previous_response_id": first["id"],
                           "input": [{"type": "function_call_output", "call_id": call["call_id"],
                                      "output": "print(1)"}]})
    assert second["previous_response_id"] == first["id"]
    requests = scripted.requests
    assert requests[2]["input_ids"] == requests[0]["input_ids"]
    assert requests[3]["input_ids"] == requests[1]["input_ids"]  # the chained history rendered the same
    finished = p.events("model_call_finished")
    shape = [(e.execution_id, e.parent_call_id is not None, e.prefix_len, e.drift_tokens) for e in finished]
    assert [s[1:] for s in shape[:2]] == [s[1:] for s in shape[2:]] and shape[1][1]
    # an item reference resolves to a stored item of this execution only
    scripted.say("ok")
    ref = {"type": "item_reference", "id": first["output"][0]["id"]}
    assert post(p, {**base, "input": [*question, ref]}, other).status_code == 200
    assert post(p, {**base, "input": [*question, ref]}).json()["error"]["param"] == "input.1.id"
    assert post(p, {**base, "previous_response_id": first["id"], "input": "x"}).status_code == 400


@pytest.mark.parametrize(("choice", "kinds"), [("auto", ["function_call"]), ("required", ["function_call"]),
                                               ({"type": "function", "name": "read_file"}, ["function_call"]),
                                               ("none", ["message"])])
def test_tool_choice_is_answered_not_enforced(scripted, start_proxy, choice, kinds: list[str]) -> None:
    """The tools are rendered whatever the choice; `none` leaves a written call as text, the others parse it
    (forcing a call would need constrained decoding: what the policy chose is what is trained)."""
    p = start_proxy({"cell0": scripted.url})
    scripted.say(tool_call("read_file", {"path": "a"}))
    reply = answer(p, {"model": "m", "input": "hi", "tools": [FUNCTION], "tool_choice": choice})
    assert [item["type"] for item in reply["output"]] == kinds
    assert '"read_file"' in prompt_of(scripted)


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_calls_of_different_kinds_come_back_in_order(scripted, start_proxy, parallel: bool) -> None:
    """Several calls in one reply (whatever `parallel_tool_calls` says: it is echoed, not enforced) come back
    as one item each, in the order written, and their echo renders to exactly what the model wrote."""
    p = start_proxy({"cell0": scripted.url})
    scripted.say(tool_call("read_file", {"path": "a"}) + tool_call("apply_patch", {"input": "*** Begin Patch"})
                 + tool_call("multi_agent_v1.wait_agent", {"targets": []}), "ok")
    body = {"model": "m", "input": [{"role": "user", "content": "go"}], "tools": [FUNCTION, CUSTOM, NAMESPACE],
            "parallel_tool_calls": parallel, "stream": True}
    first = answer(p, body)
    assert [(i["type"], i["name"]) for i in first["output"]] == [
        ("function_call", "read_file"), ("custom_tool_call", "apply_patch"), ("function_call", "wait_agent")]
    assert first["parallel_tool_calls"] is parallel
    outputs = [{"type": "custom_tool_call_output" if i["type"] == "custom_tool_call" else "function_call_output",
                "call_id": i["call_id"], "output": "done"} for i in first["output"]]
    answer(p, {**body, "input": [*body["input"], *first["output"], *outputs]})
    finished = p.events("model_call_finished")
    assert finished[1].parent_call_id == finished[0].call_id and finished[1].drift_tokens == 0
