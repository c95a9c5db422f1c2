"""The proxy's HTTP server: framing errors, limits, timeouts and the connection cap, each answered in the
shape of the API the path belongs to, before the app sees the request; the proxy keeps serving.

Raw sockets, because no client library sends a non-numeric Content-Length or stalls mid-body. The
timeout tests block on the server's answer: the server's own timer ends them, whatever the machine's load.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.proxy.proxy_helpers import TOKEN, Running, StartProxy
from tests.proxy.scripted_engine import ScriptedEngine
from tests.security_helpers import RawResponse, closed_by_server, connect, exchange, read_response, request

AUTH = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
BODY = json.dumps({"model": "c", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()
LIMIT = 4096


@pytest.fixture
def proxy(scripted: ScriptedEngine, start_proxy: StartProxy) -> Running:
    return start_proxy({"cell0": scripted.url}, max_body_bytes=LIMIT, max_header_bytes=2048)


@pytest.fixture
def impatient(scripted: ScriptedEngine, start_proxy: StartProxy) -> Running:
    """Short read timeouts (a request sent at once still makes them on a loaded machine)."""
    return start_proxy({"cell0": scripted.url}, header_timeout_s=0.5, body_timeout_s=0.5)


def anthropic_error(response: RawResponse, status: int, kind: str) -> str:
    assert response.status == status, response
    body = response.body
    assert body["type"] == "error" and body["error"]["type"] == kind and body["request_id"], body
    assert response.headers["request-id"] == body["request_id"]
    return body["error"]["message"]


def openai_error(response: RawResponse, status: int, code: str | None) -> str:
    assert response.status == status, response
    error = response.body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error["message"]


def still_serves(proxy: Running) -> None:
    with httpx.Client(base_url=proxy.url, headers=AUTH) as http:
        assert http.post("/v1/messages", content=BODY).status_code == 200


def test_bad_framing_is_answered_in_the_api_shape(proxy: Running) -> None:
    raw = request("POST", "/v1/messages", BODY, AUTH, length="12abc")
    message = anthropic_error(exchange(proxy.url, raw), 400, "invalid_request_error")
    assert "malformed HTTP request" in message and "Content-Length" in message
    for path in ("/v1/chat/completions", "/v1/responses"):
        raw = request("POST", path, BODY, AUTH, length="-1")
        assert "malformed HTTP request" in openai_error(exchange(proxy.url, raw), 400, None)
    assert "malformed" in openai_error(exchange(proxy.url, b"NOT HTTP AT ALL\r\n\r\n"), 400, None)
    two_lengths = request("POST", "/v1/messages", BODY, {**AUTH, "content-length": "3"})
    anthropic_error(exchange(proxy.url, two_lengths), 400, "invalid_request_error")
    still_serves(proxy)


def test_bodies_and_heads_over_the_limit(proxy: Running) -> None:
    declared = request("POST", "/v1/messages", b"", AUTH, length=str(10**12))  # refused before any body
    assert f"exceeds the limit of {LIMIT} bytes" in anthropic_error(exchange(proxy.url, declared), 413,
                                                                      "request_too_large")
    with connect(proxy.url) as sock:  # a client that sends its body regardless still reads the answer
        sock.sendall(request("POST", "/v1/messages", b"", AUTH, length=str(1 << 20)) + b"x" * (1 << 20))
        anthropic_error(read_response(sock), 413, "request_too_large")
    chunks = b"".join(b"400\r\n" + b"x" * 0x400 + b"\r\n" for _ in range(8)) + b"0\r\n\r\n"
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
    openai_error(exchange(proxy.url, head + chunks), 413, "request_too_large")
    big_head = request("POST", "/v1/messages", BODY, {**AUTH, "x-padding": "p" * 4096})
    assert "request head exceeds 2048 bytes" in anthropic_error(exchange(proxy.url, big_head), 413,
                                                                "request_too_large")
    still_serves(proxy)


def test_a_head_that_grows_past_the_limit_unfinished_is_refused(proxy: Running) -> None:
    """The parser keeps a header until it is whole: an endless one is refused by the bytes read so far."""
    with connect(proxy.url) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: t\r\nx-padding: ")
        sock.sendall(b"p" * 3000)  # no end of line: the head is never complete
        assert "request head exceeds 2048 bytes" in anthropic_error(read_response(sock), 413, "request_too_large")
    still_serves(proxy)


def test_a_refusal_on_a_kept_alive_connection_is_answered(proxy: Running) -> None:
    """A connection that was served answers its next request's refusal too (not a silent close)."""
    with connect(proxy.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
        assert read_response(sock).status == 200
        sock.sendall(request("POST", "/v1/chat/completions", BODY, {**AUTH, "x-padding": "p" * 4096}))
        assert "request head exceeds 2048 bytes" in openai_error(read_response(sock), 413, "request_too_large")
        assert closed_by_server(sock)
    still_serves(proxy)


def test_a_stalled_body_is_dropped(impatient: Running) -> None:
    proxy = impatient
    with connect(proxy.url) as sock:
        sock.sendall(request("POST", "/v1/messages", BODY, AUTH, length=str(len(BODY) + 10)))
        message = anthropic_error(read_response(sock), 408, "timeout_error")
        assert "request body not received within 0.5s" in message
        assert closed_by_server(sock)
    with connect(proxy.url) as sock:
        sock.sendall(request("POST", "/v1/responses", BODY[:10], AUTH, length=str(len(BODY))))
        openai_error(read_response(sock), 408, "request_timeout")
    assert not proxy.events("model_call_started")  # the app never ran a call for them
    still_serves(proxy)


def test_a_stalled_head_is_dropped(impatient: Running) -> None:
    proxy = impatient
    with connect(proxy.url) as sock:
        sock.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: t\r\n")
        assert "request head not received" in anthropic_error(read_response(sock), 408, "timeout_error")
    with connect(proxy.url) as sock:  # a connection that never says a word
        assert "request head not received" in openai_error(read_response(sock), 408, "request_timeout")
    still_serves(proxy)


def test_connections_over_the_cap_are_told_to_retry(scripted: ScriptedEngine, start_proxy: StartProxy) -> None:
    proxy = start_proxy({"cell0": scripted.url}, max_connections=2)
    health = b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n"
    first, second = connect(proxy.url), connect(proxy.url)
    try:
        for sock in (first, second):  # both served, so both are counted by the server, and kept alive
            sock.sendall(health)
            assert read_response(sock).status == 200
        refused = exchange(proxy.url, request("POST", "/v1/messages", BODY, AUTH))
        assert "limit of 2 connections" in anthropic_error(refused, 529, "overloaded_error")
        refused = exchange(proxy.url, request("POST", "/v1/chat/completions", BODY, AUTH))
        assert openai_error(refused, 503, "engine_unavailable")
        second.sendall(health)  # the admitted keep serving
        assert read_response(second).status == 200
    finally:
        first.close()
        second.close()
    for _ in range(1000):  # the server notices the closes in its own time: retry as an SDK would
        if exchange(proxy.url, health).status == 200:
            break
    else:
        raise AssertionError("the proxy did not admit a connection after two closed")
