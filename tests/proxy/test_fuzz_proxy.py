"""Fuzzing every endpoint of the proxy: whatever the body, never a server error (5xx), and every error
in the typed JSON shape of the API the path belongs to (Anthropic's, or OpenAI's for Chat and Responses)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz_helpers import FUZZ, bodies
from tests.proxy.proxy_helpers import TOKEN, Running, StartProxy
from tests.proxy.scripted_engine import ScriptedEngine

TOOLS = [{"name": "read", "description": "d", "input_schema": {"type": "object", "properties": {}}}]
ENDPOINTS: dict[str, dict[str, Any]] = {
    "/v1/messages": {"model": "c", "max_tokens": 8, "stream": False, "system": "s", "temperature": 1.0,
                     "tools": TOOLS, "stop_sequences": ["x"],
                     "messages": [{"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
                                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                                "content": "r"}]}]},
    "/v1/messages/count_tokens": {"model": "c", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/chat/completions": {"model": "m", "max_tokens": 8, "stream": False, "temperature": 0.5, "stop": ["x"],
                             "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                             "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": None,
                                           "tool_calls": [{"id": "c", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]},
                                          {"role": "tool", "tool_call_id": "c", "content": "r"}]},
    "/v1/responses": {"model": "m", "max_output_tokens": 8, "stream": False, "instructions": "s",
                      "tools": [{"type": "function", "name": "f", "parameters": {}}],
                      "input": [{"role": "user", "content": "hi"},
                                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                                {"type": "function_call_output", "call_id": "c", "output": "r"}]},
}

RESPONSES_FEATURES: dict[str, Any] = {
    "model": "m", "max_output_tokens": 8, "stream": True, "store": True, "parallel_tool_calls": False,
    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "k", "reasoning": {"effort": "low"},
    "client_metadata": {"turn_id": "t"}, "text": {"verbosity": "low"}, "tool_choice": "auto",
    "tools": [{"type": "function", "name": "f", "strict": False, "parameters": {}},
              {"type": "namespace", "name": "ns", "description": "d",
               "tools": [{"type": "function", "name": "g", "parameters": {}}]},
              {"type": "custom", "name": "apply_patch",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
              {"type": "local_shell"}, {"type": "web_search"}],
    "input": [{"type": "message", "id": "msg_d", "role": "developer",
               "content": [{"type": "input_text", "text": "d"}]},
              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
              {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}], "encrypted_content": "e"},
              {"type": "function_call", "call_id": "a", "name": "g", "namespace": "ns", "arguments": "{}"},
              {"type": "function_call_output", "call_id": "a", "output": "r"},
              {"type": "custom_tool_call", "call_id": "b", "name": "apply_patch", "input": "x"},
              {"type": "custom_tool_call_output", "call_id": "b", "output": "ok"},
              {"type": "local_shell_call", "call_id": "c", "action": {"type": "exec", "command": ["ls"]}},
              {"type": "local_shell_call_output", "call_id": "c", "output": "ok"}],
}
"""What current harnesses (Codex CLI) add to a Responses request: every tool kind, developer and reasoning
items, stateful and answered fields."""


@pytest.fixture
def proxy(scripted: ScriptedEngine, start_proxy: StartProxy) -> Running:
    return start_proxy({"cell0": scripted.url}, context_length=4096)


def assert_typed(path: str, response: httpx.Response) -> None:
    assert response.status_code < 500, (path, response.status_code, response.text)
    if response.status_code < 400:
        return
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["request_id"], body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body


def post(http: httpx.Client, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    with http.stream("POST", path, content=body, headers=headers) as response:
        response.read()  # a stream's events too: an error inside one would be a server failure
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.status_code == 200
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                json.loads(line[6:])
    return response


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_fuzz_bodies(proxy: Running, path: str) -> None:
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    with httpx.Client(base_url=proxy.url, timeout=60) as http:
        assert post(http, path, json.dumps(ENDPOINTS[path]).encode(), headers).status_code == 200  # the template

        @FUZZ
        @given(bodies(ENDPOINTS[path]))
        def check(body: bytes) -> None:
            assert_typed(path, post(http, path, body, headers))

        check()


def test_fuzz_responses_features(proxy: Running) -> None:
    """The Responses features near a valid body, chained to a stored response (`previous_response_id`,
    `item_reference`) or not: a typed answer every time."""
    headers = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    path = "/v1/responses"
    with httpx.Client(base_url=proxy.url, timeout=60) as http:
        stored = http.post(path, json={**RESPONSES_FEATURES, "stream": False}, headers=headers)
        assert stored.status_code == 200, stored.text
        chained = {**RESPONSES_FEATURES, "previous_response_id": stored.json()["id"],
                   "input": [{"type": "item_reference", "id": "msg_d"},
                             {"role": "user", "content": "more"}]}
        assert post(http, path, json.dumps(chained).encode(), headers).status_code == 200

        @FUZZ
        @given(st.sampled_from([RESPONSES_FEATURES, chained]).flatmap(bodies))
        def check(body: bytes) -> None:
            assert_typed(path, post(http, path, body, headers))

        check()


@FUZZ
@given(path=st.sampled_from([*ENDPOINTS, "/v1/models", "/v1/nope", "/health"]),
       method=st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
       headers=st.dictionaries(st.sampled_from(["authorization", "x-api-key", "content-type", "anthropic-version",
                                                "accept"]),
                               # h11 refuses to send a value with edge whitespace; the server's side of that is
                               # the raw-socket tests' job
                               st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(str.strip),
                               max_size=3))
def test_fuzz_methods_and_headers(proxy: Running, path: str, method: str, headers: dict[str, str]) -> None:
    with httpx.Client(base_url=proxy.url, timeout=60) as http:
        response = http.request(method, path, headers=headers, content=json.dumps(ENDPOINTS.get(path, {})))
    assert_typed(path, response)
