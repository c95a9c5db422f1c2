"""A re-sent conversation is validated and rendered only where it is new (`gyre.proxy.resend`, the renderer's
kept units), and the result is always the one reading it whole gives: a changed earlier message, anywhere,
is seen; a body laid out unexpectedly is read whole; errors keep their wording and field."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.proxy.anthropic_models import MessagesRequest, to_conversation, translate
from gyre.proxy.conversation import Conversation, Message, ToolCall
from gyre.proxy.errors import ApiError
from gyre.proxy.http import parse_model
from gyre.proxy.openai_models import ChatCompletionRequest
from gyre.proxy.render import ChatMLRenderer, Rendered
from gyre.proxy.resend import KEEP, ResendCache, Resent, read_resent
from tests.proxy.proxy_helpers import TOKEN


def _read(cache: ResendCache, body: dict[str, Any] | str, model: type = MessagesRequest) -> tuple[Resent, Conversation]:
    raw = (body if isinstance(body, str) else json.dumps(body)).encode()
    resent = read_resent(raw, model, "messages", cache, lambda data: parse_model(model, data))
    if model is MessagesRequest:
        conversation, items = translate(resent.body, resent.start, resent.earlier)
    else:
        conversation, items = resent.body.translate(resent.start, resent.earlier)
    resent.remember(items)
    return resent, conversation


def _whole(body: dict[str, Any] | str, model: type = MessagesRequest) -> Conversation:
    request = parse_model(model, body if isinstance(body, str) else json.dumps(body))
    return to_conversation(request) if model is MessagesRequest else request.conversation()


def _body(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 16, "system": "Be brief.", "messages": messages, **fields}


def _turns(n: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the test."}]
    for i in range(n):
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": f"Step {i}."},
            {"type": "tool_use", "id": f"toolu_{i}", "name": "bash", "input": {"cmd": "ls", "n": i}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"out {i}"}]})
    return messages


def test_a_growing_conversation_is_read_from_where_it_is_new() -> None:
    cache = ResendCache()
    messages = _turns(1)
    resent, conversation = _read(cache, _body(messages))
    assert resent.start == 0 and conversation == _whole(_body(messages))
    for n in range(2, 6):
        messages = _turns(n)
        resent, conversation = _read(cache, _body(messages))
        assert resent.start == len(_turns(n - 1))  # the previous request's messages, reused
        assert len(resent.body.messages) == 2
        assert conversation == _whole(_body(messages))
    resent, conversation = _read(cache, _body(messages))  # a retry: the last message is read again
    assert resent.start == len(messages) - 1 and conversation == _whole(_body(messages))


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m[0].__setitem__("content", "Fix the other test."),  # the first message's text
        lambda m: m[0].__setitem__("content", "Fix the best."),  # the same length: only the bytes differ
        lambda m: m[4]["content"][0].__setitem__("content", "out 7"),  # a tool result, the same length
        lambda m: m[3]["content"][1]["input"].__setitem__("n", 1.0),  # 1 -> 1.0: equal in Python, not as text
        lambda m: m[3]["content"][1]["input"].__setitem__("n", True),  # 1 -> true: equal in Python too
        lambda m: m[4]["content"][0].__setitem__("content", "out 1 (edited)"),
        lambda m: m.pop(2),  # a message dropped from the middle
        lambda m: m.insert(1, {"role": "user", "content": "An aside."}),
    ],
)
def test_a_changed_earlier_message_is_read_anew(edit: Any) -> None:
    cache = ResendCache()
    messages = _turns(3)
    _read(cache, _body(messages))
    edited = json.loads(json.dumps(_turns(4)))
    edit(edited)
    resent, conversation = _read(cache, _body(edited))
    assert conversation == _whole(_body(edited))
    assert ChatMLRenderer().render(conversation).units == ChatMLRenderer().render(_whole(_body(edited))).units
    assert resent.start < len(messages)


def test_the_same_messages_laid_out_differently_are_read_whole_and_right() -> None:
    cache = ResendCache()
    messages = _turns(2)
    _read(cache, _body(messages))
    longer = _turns(3)
    for text in (
        json.dumps(_body(longer), indent=2),  # other whitespace: no element matches byte for byte
        json.dumps({"messages": longer, "model": "m", "max_tokens": 16, "system": "Be brief."}),  # array first
        json.dumps(_body(longer, temperature=0.5)),  # another field after the array
    ):
        resent, conversation = _read(cache, text)
        assert conversation == _whole(text) and resent.body.max_tokens == 16
    # the array given twice: the model's own rule (the last one wins) decides, as without the cache
    twice = json.dumps(_body(longer))[:-1] + ', "messages": ' + json.dumps(_turns(1)) + "}"
    resent, conversation = _read(cache, twice)
    assert resent.start == 0 and conversation == _whole(twice)


@pytest.mark.parametrize(
    ("bad", "param"),
    [
        ({"role": "robot", "content": "hi"}, "messages.7.role"),  # invalid by the model: pydantic's error
        ({"role": "assistant", "content": [{"type": "image", "source": {}}]}, "messages.7.content.0.type"),
        ("not an object", "messages.7"),
    ],
)
def test_an_invalid_new_message_is_the_error_reading_it_whole_gives(bad: Any, param: str) -> None:
    cache = ResendCache()
    _read(cache, _body(_turns(3)))
    body = _body([*_turns(3), bad])
    with pytest.raises(ApiError) as cached:
        _read(cache, body)
    with pytest.raises(ApiError) as whole:
        _whole(body)
    assert (cached.value.kind, cached.value.message, cached.value.param) == (
        whole.value.kind, whole.value.message, whole.value.param)
    assert cached.value.param is not None and cached.value.param.startswith(param)


def test_interleaved_agents_each_reuse_their_own_conversation() -> None:
    cache = ResendCache()
    agents = [[{"role": "user", "content": f"Agent {a}'s task."}] for a in range(KEEP)]
    for step in range(3):
        for a, messages in enumerate(agents):
            messages += [{"role": "assistant", "content": f"a{a} s{step}"}, {"role": "user", "content": "go on"}]
            resent, conversation = _read(cache, _body(messages))
            assert conversation == _whole(_body(messages))
            assert resent.start == (len(messages) - 2 if step else 0)


def test_openai_messages_are_reused_one_by_one() -> None:
    cache = ResendCache()
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}]
    for i in range(4):
        messages = [*messages,
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": f"c{i}", "type": "function", "function": {"name": "bash", "arguments": '{"n": 1}'}}]},
                    {"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i}"}]
        body = {"model": "m", "messages": messages}
        resent, conversation = _read(cache, body, ChatCompletionRequest)
        assert conversation == _whole(body, ChatCompletionRequest)
        assert resent.start == (len(messages) - 2 if i else 0)


# -- the property: whatever a harness does to its conversation, the cached read is the whole read ----------

_TEXT = st.text(alphabet="ab \n\u00e9{}\"\\", max_size=6)
_MESSAGE = st.one_of(
    st.builds(lambda t: {"role": "user", "content": t}, _TEXT),
    st.builds(lambda t, n: {"role": "assistant", "content": [
        {"type": "text", "text": t}, {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"n": n}}]},
        _TEXT, st.one_of(st.integers(0, 2), st.floats(0, 2), st.booleans())),
    st.builds(lambda t: {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": t}]},
              _TEXT),
)
_STEP = st.one_of(
    st.tuples(st.just("append"), st.lists(_MESSAGE, min_size=1, max_size=3)),
    st.tuples(st.just("edit"), st.tuples(st.integers(0, 50), _MESSAGE)),
    st.tuples(st.just("cut"), st.integers(1, 50)),
    st.tuples(st.just("spacing"), st.sampled_from([None, 1, (",", ":")])),
    st.tuples(st.just("retry"), st.none()),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_STEP, min_size=1, max_size=12))
def test_reading_with_the_cache_is_reading_whole(steps: list[tuple[str, Any]]) -> None:
    cache = ResendCache()
    renderer, kept = ChatMLRenderer(), []  # type: ignore[var-annotated]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "task"}]
    spacing: Any = None
    for kind, arg in steps:
        if kind == "append":
            messages = [*messages, *arg]
        elif kind == "edit":
            messages = [*messages]
            messages[arg[0] % len(messages)] = arg[1]
        elif kind == "cut":
            messages = messages[: max(1, len(messages) - arg)]
        elif kind == "spacing":
            spacing = arg
        text = (json.dumps(_body(messages), indent=spacing) if not isinstance(spacing, tuple)
                else json.dumps(_body(messages), separators=spacing))
        _, conversation = _read(cache, text)
        whole = _whole(text)
        assert conversation == whole
        assert renderer.render(conversation, kept).units == renderer.render(whole).units


def test_an_assistant_turn_replaced_by_another_is_read_from_there() -> None:
    cache = ResendCache()
    messages = _turns(2)
    _read(cache, _body(messages))
    messages[1] = {"role": "assistant", "content": "changed"}
    resent, conversation = _read(cache, _body(messages))
    assert resent.start == 1 and conversation.messages[2] == Message("assistant", "changed")


# -- the renderer's kept units --------------------------------------------------------------------------


def _conv(*messages: Message) -> Conversation:
    return Conversation(messages)


def test_kept_units_are_reused_only_for_the_same_message_objects() -> None:
    renderer, kept = ChatMLRenderer(), []  # type: ignore[var-annotated]
    system, task = Message("system", "Be brief."), Message("user", "Go.")
    turn = Message("assistant", "ok", (ToolCall("c1", "bash", {"n": 1}),))
    first = _conv(system, task, turn, Message("tool", "out"))
    assert renderer.render(first, kept).units == renderer.render(first).units and len(kept) == 1
    # a run of tool results continued by the next request: one unit, rendered anew, not the kept one
    second = _conv(*first.messages, Message("tool", "more"))
    assert renderer.render(second, kept).units == renderer.render(second).units and len(kept) == 1
    # an equal but new object for an earlier message: still right (identity decides what is reused)
    third = _conv(system, Message("user", "Go."), turn, Message("tool", "out"), Message("user", "next"))
    assert renderer.render(third, kept).units == renderer.render(third).units
    # a changed earlier message, the rest the same objects
    fourth = _conv(system, Message("user", "Stop."), turn, Message("tool", "out"))
    assert renderer.render(fourth, kept).units == renderer.render(fourth).units
    # another system prompt: a different header, nothing reused
    fifth = _conv(Message("system", "Be long."), *third.messages[1:])
    assert renderer.render(fifth, kept).units == renderer.render(fifth).units
    assert all(isinstance(r, Rendered) for r in kept) and len(kept) <= 4


# -- through the HTTP front ends: a changed earlier message reaches the engine, on all three APIs -----------


def _request(api: str, history: list[str]) -> tuple[str, dict[str, Any]]:
    """A conversation of alternating user / assistant texts, as `api` sends it."""
    if api == "anthropic":
        messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(history)]
        return "/v1/messages", {"model": "m", "max_tokens": 8, "system": "Be brief.", "messages": messages}
    if api == "openai":
        messages = [{"role": "system", "content": "Be brief."}]
        messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(history)]
        return "/v1/chat/completions", {"model": "m", "max_tokens": 8, "messages": messages}
    items = [{"role": "user", "content": t} if i % 2 == 0 else
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": t}]}
             for i, t in enumerate(history)]
    return "/v1/responses", {"model": "m", "max_output_tokens": 8, "instructions": "Be brief.", "input": items}


@pytest.mark.parametrize("api", ["anthropic", "openai", "responses"])
def test_a_changed_earlier_message_reaches_the_engine(api: str, scripted, start_proxy) -> None:
    p = start_proxy({"cell0": scripted.url})
    headers = {"x-api-key": TOKEN, "authorization": f"Bearer {TOKEN}"}
    history = ["Fix the test in a.py.", "Done.", "Now b.py.", "Done too.", "Thanks."]
    with httpx.Client(base_url=p.url, timeout=30, headers=headers) as http:
        for n in (1, 3, 5):  # a growing conversation: later reads reuse the earlier messages
            scripted.say(history[n] if n < len(history) else "ok")
            assert _post(http, api, history[:n]).status_code == 200
        edited = ["Fix the test in c.py.", *history[1:]]  # the first message changed, the rest the same bytes
        scripted.say("ok")
        assert _post(http, api, edited).status_code == 200
        changed_ids = scripted.requests[-1]["input_ids"]
    fresh = start_proxy({"cell0": scripted.url}, execution_id="exec-2")
    with httpx.Client(base_url=fresh.url, timeout=30, headers=headers) as http:
        scripted.say("ok")
        assert _post(http, api, edited).status_code == 200
    assert changed_ids == scripted.requests[-1]["input_ids"]  # what a proxy that never saw the old text sends
    assert "c.py" in scripted.tokenizer.decode(changed_ids)
    assert p.events("model_call_started")[-1].parent_call_id is None  # a new root: no recorded call matches


def _post(http: httpx.Client, api: str, history: list[str]) -> httpx.Response:
    path, body = _request(api, history)
    return http.post(path, json=body)


@pytest.mark.parametrize("ensure_ascii", [False, True])
def test_non_ascii_text_is_reused_too(ensure_ascii: bool) -> None:
    """Offsets are bytes of the UTF-8 body: text with multi-byte characters, raw or escaped, still matches."""
    cache = ResendCache()
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Corrige le test é 🚀."}]
    for i in range(3):
        turn = [{"role": "assistant", "content": f"ça marche {i} ✓"}, {"role": "user", "content": "encore"}]
        messages = [*messages, *turn]
        text = json.dumps({**_body(messages), "metadata": {"user_id": "ü"}}, ensure_ascii=ensure_ascii)
        resent, conversation = _read(cache, text)
        assert conversation == _whole(text) and resent.start == (len(messages) - 2 if i else 0)
