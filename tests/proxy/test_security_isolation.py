"""One execution's token can never read or write another execution's calls, through every front end.

What a call "reads" of earlier calls is the execution's call tree: a call that extends an earlier call's
conversation becomes its child and reuses its exact token ids. So the test sends, with execution A's
token, the very conversation execution B just had: it must start a root in A's tree, be recorded under
A, and leave B's tree as it was; B continuing its own conversation still extends its own call.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gyre.proxy.core import Proxy
from tests.proxy.proxy_helpers import TOKEN, Running, StartProxy
from tests.proxy.scripted_engine import ScriptedEngine

OTHER = "exec-token-other-abcdefghij"
FRONT_ENDS = ["anthropic", "chat", "responses"]


def call(http: httpx.Client, front: str, token: str, turns: list[tuple[str, str]], **extra: Any) -> httpx.Response:
    """One call of `front` with `turns` ((role, text) pairs) as the history."""
    messages = [{"role": role, "content": text} for role, text in turns]
    headers = {"authorization": f"Bearer {token}"}
    if front == "anthropic":
        return http.post("/v1/messages", headers=headers, json={"model": "c", "max_tokens": 8, "messages": messages,
                                                                **extra})
    if front == "chat":
        return http.post("/v1/chat/completions", headers=headers,
                         json={"model": "m", "max_tokens": 8, "messages": messages, **extra})
    return http.post("/v1/responses", headers=headers,
                     json={"model": "m", "max_output_tokens": 8, "input": messages, **extra})


@pytest.fixture
def two(scripted: ScriptedEngine, start_proxy: StartProxy) -> Running:
    p = start_proxy({"cell0": scripted.url}, execution_id="exec-a")
    p.server.register_execution("exec-b", OTHER)
    return p


def calls_of(proxy: Proxy, execution_id: str) -> int:
    return proxy.registry.get(execution_id).calls_started


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_a_token_cannot_extend_or_be_recorded_under_another_execution(two: Running, scripted: ScriptedEngine,
                                                                      front: str) -> None:
    history = [("user", "hi")]
    with httpx.Client(base_url=two.url) as http:
        scripted.say("hello there")
        assert call(http, front, OTHER, history).status_code == 200  # B's first call
        continued = [*history, ("assistant", "hello there"), ("user", "and now?")]
        scripted.say("ok", "fine")
        # A sends B's conversation, and claims to be B every way a request can say so.
        spoof = {"metadata": {"user_id": "exec-b"}} if front == "anthropic" else {"user": "exec-b"}
        a = call(http, front, TOKEN, continued, **spoof)
        assert a.status_code == 200, a.text
        assert calls_of(two.proxy, "exec-b") == 1 and calls_of(two.proxy, "exec-a") == 1
        assert call(http, front, OTHER, continued).status_code == 200  # B's own continuation
    b_first, a_call, b_second = two.events("model_call_started")
    assert (b_first.execution_id, a_call.execution_id, b_second.execution_id) == ("exec-b", "exec-a", "exec-b")
    assert a_call.parent_call_id is None  # a root in A's tree: nothing of B's call was reused
    assert b_second.parent_call_id == b_first.call_id  # B's tree was left as B made it
    assert all(c.call_id.startswith(c.execution_id + "/") for c in (b_first, a_call, b_second))
    finished = {c.call_id: c.execution_id for c in two.events("model_call_finished")}
    assert finished == {b_first.call_id: "exec-b", a_call.call_id: "exec-a", b_second.call_id: "exec-b"}


@pytest.mark.parametrize("front", FRONT_ENDS)
def test_an_unregistered_token_is_refused_and_the_other_keeps_working(two: Running, front: str) -> None:
    two.proxy.unregister_execution("exec-b")
    with httpx.Client(base_url=two.url) as http:
        assert call(http, front, OTHER, [("user", "hi")]).status_code == 401
        assert call(http, front, OTHER[:-1], [("user", "hi")]).status_code == 401  # near misses too
        assert call(http, front, TOKEN, [("user", "hi")]).status_code == 200
    assert [c.execution_id for c in two.events("model_call_started")] == ["exec-a"]


def test_a_token_belongs_to_one_execution(two: Running) -> None:
    with pytest.raises(ValueError, match="already in use"):
        two.server.register_execution("exec-c", OTHER)
