"""Auth and malformed requests get typed 4xx answers in the API's own error shape; the proxy keeps serving."""

from __future__ import annotations

import json
import socket

import anthropic
import httpx
import openai
import pytest

from tests.proxy.proxy_helpers import TOKEN, Running, StartProxy
from tests.proxy.scripted_engine import ScriptedEngine

GOOD_ANTHROPIC = {"model": "c", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
GOOD_OPENAI = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def proxy(scripted: ScriptedEngine, start_proxy: StartProxy) -> Running:
    return start_proxy({"cell0": scripted.url}, max_body_bytes=4096)


def _anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["request_id"]
    return body["error"]["message"]


def _openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param
    return error


def test_auth_in_both_shapes(proxy: Running) -> None:
    with httpx.Client(base_url=proxy.url) as http:
        _anthropic_error(http.post("/v1/messages", json=GOOD_ANTHROPIC), 401, "authentication_error")
        _anthropic_error(
            http.post("/v1/messages", json=GOOD_ANTHROPIC, headers={"x-api-key": "nope" * 5}),
            401,
            "authentication_error",
        )
        error = _openai_error(
            http.post(
                "/v1/chat/completions", json=GOOD_OPENAI, headers={"authorization": "Bearer wrong-token-xxxxxxxx"}
            ),
            401,
        )
        assert error["code"] == "invalid_api_key"
        _openai_error(http.get("/v1/models"), 401)
        assert http.post("/v1/messages", json=GOOD_ANTHROPIC, headers={"x-api-key": TOKEN}).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=proxy.url, api_key="x" * 20, max_retries=0).messages.create(**GOOD_ANTHROPIC)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{proxy.url}/v1", api_key="x" * 20, max_retries=0).models.list()
    proxy.proxy.unregister_execution("exec-1")
    with httpx.Client(base_url=proxy.url) as http:
        _anthropic_error(http.post("/v1/messages", json=GOOD_ANTHROPIC, headers=AUTH), 401, "authentication_error")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "c", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({**GOOD_ANTHROPIC, "max_tokens": "ten"}, "max_tokens"),
        ({**GOOD_ANTHROPIC, "max_tokens": 0}, "max_tokens"),
        ({**GOOD_ANTHROPIC, "messages": "hi"}, "messages"),
        ({**GOOD_ANTHROPIC, "messages": []}, "messages"),
        ({**GOOD_ANTHROPIC, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({**GOOD_ANTHROPIC, "messages": [{"role": "user", "content": [{"type": "video", "x": 1}]}]}, "messages.0"),
        (
            {
                **GOOD_ANTHROPIC,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
                        ],
                    }
                ],
            },
            "messages.0.content.0.type",
        ),
        ({**GOOD_ANTHROPIC, "temperature": 1.5}, "temperature"),
        ({**GOOD_ANTHROPIC, "stop_sequences": [""]}, "stop_sequences.0"),
    ],
)
def test_anthropic_malformed_bodies(proxy: Running, body: dict, field: str) -> None:
    with httpx.Client(base_url=proxy.url, headers=AUTH) as http:
        message = _anthropic_error(http.post("/v1/messages", json=body), 400, "invalid_request_error")
        assert field in message
        assert http.post("/v1/messages", json=GOOD_ANTHROPIC).status_code == 200  # still serving


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "messages"),
        ({**GOOD_OPENAI, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0"),
        ({**GOOD_OPENAI, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool.tool_call_id"),
        ({**GOOD_OPENAI, "temperature": 3}, "temperature"),
        ({**GOOD_OPENAI, "max_tokens": -1}, "max_tokens"),
        ({**GOOD_OPENAI, "n": 2}, "n"),
        ({**GOOD_OPENAI, "top_logprobs": 5}, "top_logprobs"),
        ({**GOOD_OPENAI, "response_format": {"type": "json_object"}}, "response_format.type"),
        (
            {
                **GOOD_OPENAI,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            "messages.0.content.0.type",
        ),
    ],
)
def test_openai_malformed_bodies(proxy: Running, body: dict, param: str) -> None:
    with httpx.Client(base_url=proxy.url, headers=AUTH) as http:
        error = _openai_error(http.post("/v1/chat/completions", json=body), 400, param)
        assert error["type"] == "invalid_request_error"
        assert http.post("/v1/chat/completions", json=GOOD_OPENAI).status_code == 200


def test_bad_json_oversized_and_unknown_routes(proxy: Running) -> None:
    with httpx.Client(base_url=proxy.url, headers=AUTH) as http:
        for path, check in (
            ("/v1/messages", lambda r, s: _anthropic_error(r, s, "invalid_request_error")),
            ("/v1/chat/completions", lambda r, s: _openai_error(r, s, "body")),
        ):
            check(
                http.post(path, content=b'{"model": "m", "messages": [', headers={"content-type": "application/json"}),
                400,
            )
            check(http.post(path, content=b"[1, 2]"), 400)
            check(http.post(path, content=b""), 400)
        big = {**GOOD_ANTHROPIC, "messages": [{"role": "user", "content": "x" * 10_000}]}
        _anthropic_error(http.post("/v1/messages", json=big), 413, "request_too_large")
        _openai_error(http.post("/v1/chat/completions", json={**GOOD_OPENAI, "user": "x" * 10_000}), 413)
        chunked = http.post(
            "/v1/messages", content=iter([json.dumps(big).encode()[i : i + 1000] for i in range(0, 11_000, 1000)])
        )
        _anthropic_error(chunked, 413, "request_too_large")
        _anthropic_error(http.post("/v1/messages/nope", json={}), 404, "not_found_error")
        _anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
        _openai_error(http.get("/v1/nothing"), 404)
        assert http.post("/v1/messages", json=GOOD_ANTHROPIC).status_code == 200
        assert http.post("/v1/chat/completions", json=GOOD_OPENAI).status_code == 200


def test_engine_down_is_retryable_and_recorded(start_proxy: StartProxy) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket closes
    p = start_proxy({"cell0": dead})
    with httpx.Client(base_url=p.url, headers=AUTH) as http:
        _anthropic_error(http.post("/v1/messages", json=GOOD_ANTHROPIC), 529, "overloaded_error")
        error = _openai_error(http.post("/v1/chat/completions", json=GOOD_OPENAI), 503)
        assert error["type"] == "server_error"
    finished = p.events("model_call_finished")
    assert [c.finish_reason for c in finished] == ["abort", "abort"] and not finished[0].output_ids


def test_a_bug_in_a_model_call_is_a_500_in_the_apis_shape_and_logged(
    proxy: Running, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Model calls skip Starlette's middleware (`gyre.proxy.app.ProxyApp`): its error mapping still holds."""

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(proxy.proxy, "begin", broken)
    # one connection per request: uvicorn closes a connection whose app raised, after its answer
    with httpx.Client(base_url=proxy.url) as http:
        message = _anthropic_error(http.post("/v1/messages", json=GOOD_ANTHROPIC, headers=AUTH), 500, "api_error")
    assert "RuntimeError('a bug')" in message
    with httpx.Client(base_url=proxy.url) as http:
        error = _openai_error(http.post("/v1/chat/completions", json=GOOD_OPENAI, headers=AUTH), 500)
    assert error["type"] == "server_error" and "a bug" in error["message"]
    assert any("unexpected error serving POST /v1/messages" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    with httpx.Client(base_url=proxy.url) as http:
        assert http.post("/v1/messages", json=GOOD_ANTHROPIC, headers=AUTH).status_code == 200
