"""What Claude Code needs beyond the SDK basics: `system` inside `messages`, and an overlong prompt refused
before any byte of the answer with the error Anthropic gives (a 400 the client does not retry)."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import openai
import pytest

from gyre.model.tokenizer import build_tokenizer
from gyre.proxy.transport import engine_link
from tests.proxy.proxy_helpers import TOKEN


def test_system_message_inside_messages_renders_as_a_system_turn(scripted, start_proxy) -> None:
    p = start_proxy({"cell0": scripted.url})
    scripted.say("ok")
    client = anthropic.Anthropic(base_url=p.url, auth_token=TOKEN, max_retries=0, timeout=30)
    client.messages.create(
        model="claude",
        max_tokens=20,
        system="You are an agent.",
        messages=[  # type: ignore[list-item]  # the newer beta the typed SDK does not know yet
            {"role": "user", "content": "hi"},
            {"role": "system", "content": [{"type": "text", "text": "Reminder: be brief."}]},
        ],
    )
    prompt = build_tokenizer().decode(scripted.requests[0]["input_ids"])
    assert prompt == (
        "<|im_start|>system\nYou are an agent.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>system\nReminder: be brief.<|im_end|>\n<|im_start|>assistant\n"
    )


def _long(n: int) -> str:
    return "x" * n  # one byte-level token per byte


@pytest.mark.parametrize("stream", [False, True])
def test_overlong_prompt_is_refused_before_the_answer_starts(scripted, start_proxy, stream: bool) -> None:
    p = start_proxy({"cell0": scripted.url}, context_length=200)
    client = anthropic.Anthropic(base_url=p.url, auth_token=TOKEN, max_retries=2, timeout=30)
    seen: list[httpx.Request] = []
    client._client.event_hooks["request"].append(seen.append)
    kwargs = {"model": "claude", "max_tokens": 10, "messages": [{"role": "user", "content": _long(300)}]}
    with pytest.raises(anthropic.BadRequestError) as info:
        if stream:
            with client.messages.stream(**kwargs) as s:
                s.get_final_message()
        else:
            client.messages.create(**kwargs)
    assert info.value.status_code == 400
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("prompt is too long: ") and error["message"].endswith("> 199 maximum")
    assert len(seen) == 1  # a 400 is not retried (a 5xx, or an error after the 200, would be)
    assert scripted.requests == [] and p.events("model_call_started") == []
    # a prompt that fits still goes through
    scripted.say("ok")
    assert client.messages.create(**{**kwargs, "messages": [{"role": "user", "content": "hi"}]}).content


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_overlong_prompt_openai_shapes(scripted, start_proxy, api: str) -> None:
    p = start_proxy({"cell0": scripted.url}, context_length=100)
    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key=TOKEN, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as info:
        if api == "chat":
            client.chat.completions.create(model="m", stream=True, messages=[{"role": "user", "content": _long(200)}])
        else:
            client.responses.create(model="m", stream=True, input=_long(200))
    assert info.value.code == "context_length_exceeded" and scripted.requests == []


def test_context_length_is_learned_from_the_local_engine(engine_server) -> None:
    async def ask() -> int | None:
        link = engine_link(engine_server.url)
        try:
            return await link.context_length()
        finally:
            await link.aclose()

    assert asyncio.run(ask()) == engine_server.engine.runner.max_positions == 131072


def test_scripted_engine_without_model_info_means_no_check(scripted) -> None:
    async def ask() -> int | None:
        link = engine_link(scripted.url)
        try:
            return await link.context_length()
        finally:
            await link.aclose()

    assert asyncio.run(ask()) is None
