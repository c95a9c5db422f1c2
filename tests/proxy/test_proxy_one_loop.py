"""The three front ends answer the same way, plain and streamed, because one loop (`gyre.proxy.turn`) runs
them: an engine abort carries its message, an engine refusal is the harness's error, an over-long prompt is
refused before the engine sees it, a lost engine is a retryable error."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi.responses import JSONResponse, StreamingResponse

from gyre.proxy.turn import GENERATED_AT, STARTED_AT
from tests.proxy.proxy_helpers import TOKEN, StartProxy
from tests.proxy.scripted_engine import ScriptedEngine

APIS = ("anthropic", "openai", "responses")
OVERLOADED = {"anthropic": (529, "overloaded_error"), "openai": (503, "server_error"),
              "responses": (503, "server_error")}
INVALID = {"anthropic": (400, "invalid_request_error"), "openai": (400, "invalid_request_error"),
           "responses": (400, "invalid_request_error")}


class _FaultyEngine(ScriptedEngine):
    """A scripted engine that aborts every call (with a message) or refuses it with a 400."""

    mode = "abort"

    async def generate(self, body: dict[str, Any]) -> Any:
        if self.mode == "reject":
            return JSONResponse({"error": "input_ids: malformed"}, status_code=400)
        result = self._result(body["rid"], body["input_ids"], [], body.get("sampling_params", {}), True)
        result["meta_info"]["finish_reason"] = {"type": "abort", "message": "kv cache full"}
        if not body.get("stream"):
            return JSONResponse(result)

        async def chunks() -> Iterator[str]:  # type: ignore[misc]
            yield f"data: {json.dumps(result)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")


@pytest.fixture
def faulty() -> Iterator[_FaultyEngine]:
    engine = _FaultyEngine()
    engine.start()
    yield engine
    engine.stop()


def _call(url: str, api: str, *, stream: bool, text: str = "hello") -> tuple[int, str]:
    reply = _post(url, api, stream=stream, text=text)
    return reply.status_code, reply.text


def _post(url: str, api: str, *, stream: bool, text: str = "hello") -> httpx.Response:
    if api == "anthropic":
        path, headers = "/v1/messages", {"x-api-key": TOKEN}
        body: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
    elif api == "openai":
        path, headers = "/v1/chat/completions", {"authorization": f"Bearer {TOKEN}"}
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}
    else:
        path, headers = "/v1/responses", {"authorization": f"Bearer {TOKEN}"}
        body = {"model": "m", "max_output_tokens": 8, "input": text}
    with httpx.Client(base_url=url, timeout=60) as http:
        return http.post(path, headers=headers, json={**body, "stream": stream})


def _error(api: str, text: str, *, streamed: bool) -> tuple[str, str]:
    """(type or code, message) of the error a plain answer or a stream's failure event carries."""
    if streamed:
        data = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")][-1]
        if api == "responses":
            assert data["type"] == "response.failed" and data["response"]["status"] == "failed"
            return data["response"]["error"]["code"], data["response"]["error"]["message"]
    else:
        data = json.loads(text)
    return data["error"].get("code") or data["error"]["type"], data["error"]["message"]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_abort_carries_its_message(faulty: _FaultyEngine, start_proxy: StartProxy, api: str,
                                             stream: bool) -> None:
    p = start_proxy({"cell0": faulty.url})
    status, text = _call(p.url, api, stream=stream)
    kind, message = _error(api, text, streamed=stream)
    assert message == "the engine aborted the call: kv cache full"
    if stream:
        assert status == 200 and kind in ("overloaded_error", "engine_unavailable")
    else:
        assert (status, kind) in (OVERLOADED[api], (503, "engine_unavailable"))
    (finished,) = p.events("model_call_finished")
    assert finished.finish_reason == "abort"


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_refusal_is_the_harness_s_error(faulty: _FaultyEngine, start_proxy: StartProxy, api: str,
                                                  stream: bool) -> None:
    faulty.mode = "reject"
    p = start_proxy({"cell0": faulty.url})
    status, text = _call(p.url, api, stream=stream)
    kind, message = _error(api, text, streamed=stream)
    assert message.startswith("the engine rejected the request: ") and "input_ids: malformed" in message
    assert status == (200 if stream else 400) and kind == "invalid_request_error"
    assert not p.proxy.router.is_down("cell0")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True])
def test_an_over_long_prompt_is_refused_before_the_engine(faulty: _FaultyEngine, start_proxy: StartProxy,
                                                          api: str, stream: bool) -> None:
    p = start_proxy({"cell0": faulty.url}, context_length=64)
    status, text = _call(p.url, api, stream=stream, text="word " * 200)
    kind, message = _error(api, text, streamed=False)  # refused before any 200
    assert status == 400 and message.startswith("prompt is too long: ")
    assert kind == ("invalid_request_error" if api == "anthropic" else "context_length_exceeded")
    assert faulty.requests == []


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True])
def test_a_lost_engine_is_a_retryable_error(start_proxy: StartProxy, api: str, stream: bool) -> None:
    with socket.socket() as sock:  # a port nobody listens on: the engine is gone
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = start_proxy({"cell0": f"http://127.0.0.1:{port}"}, engine_lost_wait_s=0, context_length=4096)
    status, text = _call(p.url, api, stream=stream)
    kind, message = _error(api, text, streamed=stream)
    assert message.startswith("the engine is unavailable") or "no other cell admitted" in message
    if stream:
        assert status == 200 and kind in ("overloaded_error", "engine_unavailable")
    else:
        assert (status, kind) in (OVERLOADED[api], (503, "engine_unavailable"))


@pytest.mark.parametrize("api", APIS)
def test_a_plain_answer_says_when_the_model_finished_it(scripted: ScriptedEngine, start_proxy: StartProxy,
                                                        api: str) -> None:
    """``gyre-generated-at``: the engine's answer reached the proxy after the request was sent and before
    the reply came back; a harness that paces itself by model time counts from it (the scenario agent).
    ``gyre-started-at``: the proxy opened the call between the send and that answer."""
    scripted.say("hi")
    p = start_proxy({"cell0": scripted.url})
    sent = time.time()
    reply = _post(p.url, api, stream=False)
    received = time.time()
    assert reply.status_code == 200, reply.text
    assert sent <= float(reply.headers[STARTED_AT]) <= float(reply.headers[GENERATED_AT]) <= received


class _HangingEngine(ScriptedEngine):
    """A scripted engine that holds every generation until it is asked to abort it."""

    def __init__(self) -> None:
        super().__init__()
        self.received = threading.Event()
        self.aborted = threading.Event()
        self.abort_rids: list[str] = []

    async def generate(self, body: dict[str, Any]) -> Any:
        self.received.set()
        await asyncio.get_running_loop().run_in_executor(None, self.aborted.wait, 60)
        result = self._result(body["rid"], body["input_ids"], [], body.get("sampling_params", {}), True)
        result["meta_info"]["finish_reason"] = {"type": "abort", "message": "aborted"}
        return JSONResponse(result)

    async def abort(self, body: dict[str, Any]) -> Any:
        self.abort_rids.append(body["rid"])
        self.aborted.set()
        return {"success": True, "aborted": 1}


_RAW = {"anthropic": ("/v1/messages", "x-api-key: " + TOKEN,
                      {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}),
        "openai": ("/v1/chat/completions", "authorization: Bearer " + TOKEN,
                   {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}),
        "responses": ("/v1/responses", "authorization: Bearer " + TOKEN,
                      {"model": "m", "max_output_tokens": 8, "input": "hello"})}


@pytest.mark.parametrize("api", APIS)
def test_a_harness_that_hangs_up_aborts_its_call_at_once(start_proxy: StartProxy, api: str) -> None:
    """The connection's loss cancels a plain call where it waits: the engine is told to abort and the call is
    recorded as aborted, without waiting for a poll (an hour apart here)."""
    engine = _HangingEngine()
    engine.start()
    try:
        p = start_proxy({"cell0": engine.url}, disconnect_poll_s=3600.0, context_length=4096)
        path, auth, body = _RAW[api]
        payload = json.dumps(body).encode()
        host, port = p.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nhost: proxy\r\n{auth}\r\ncontent-type: application/json\r\n"
                         f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
            assert engine.received.wait(30), "the engine never saw the call"
        assert engine.aborted.wait(10), "the hang-up did not abort the engine's request"
        (request,) = engine.requests
        assert engine.abort_rids == [request["rid"]]
        (finished,) = p.events("model_call_finished")
        assert finished.finish_reason == "abort" and finished.output_ids == []
    finally:
        engine.aborted.set()
        engine.stop()


def test_a_connection_lost_before_the_watch_never_starts_the_work() -> None:
    """Watching a connection already lost answers `ClientGone` at once, after `on_gone`, without starting the
    work and without leaving a cancel pending in the request's task."""
    from starlette.requests import Request as StarletteRequest

    from gyre.http_server import ON_DISCONNECT
    from gyre.proxy.http import ClientGone, until_disconnect

    def already_lost(watcher: Any) -> Any:
        watcher()
        return lambda: None

    started: list[bool] = []
    told: list[bool] = []

    async def work() -> int:
        started.append(True)
        return 1

    async def main() -> str:
        request = StarletteRequest({"type": "http", ON_DISCONNECT: already_lost})
        with pytest.raises(ClientGone):
            await until_disconnect(request, work(), 3600.0, lambda: told.append(True))
        await asyncio.sleep(0)  # a cancel left pending would be raised here
        return "went on"

    assert asyncio.run(main()) == "went on"
    assert told == [True] and started == []
