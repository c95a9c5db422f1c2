"""The engine's HTTP server: framing errors, limits, timeouts and the connection cap are answered in the
engine's error shape (`{"error": {"message", "field", "type"}}`) before the app runs; it keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
from gyre.http_server import ServerLimits
from tests.security_helpers import RawResponse, connect, exchange, read_response, request

BODY = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}).encode()


@pytest.fixture(scope="module")
def engine() -> Iterator[LocalEngineServer]:
    limits = ServerLimits(max_body_bytes=4096, max_header_bytes=2048, header_timeout_s=0.5, body_timeout_s=0.5,
                          max_connections=3)
    server = LocalEngineServer(LocalEngine(LocalEngineConfig(seed=0)), limits=limits)
    server.start()
    yield server
    server.stop()


def engine_error(response: RawResponse, status: int, kind: str) -> str:
    assert response.status == status, response
    error = response.body["error"]
    assert set(error) == {"message", "field", "type"} and error["type"] == kind, error
    return error["message"]


def still_serves(engine: LocalEngineServer) -> None:
    assert httpx.post(f"{engine.url}/generate", content=BODY).status_code == 200


def test_framing_limits_and_timeouts(engine: LocalEngineServer) -> None:
    raw = request("POST", "/generate", BODY, length="x1")
    assert "malformed HTTP request" in engine_error(exchange(engine.url, raw), 400, "invalid_request_error")
    raw = request("POST", "/update_weights_from_tensor", b"", length=str(1 << 40))
    assert "exceeds the limit of 4096" in engine_error(exchange(engine.url, raw), 413, "request_too_large")
    raw = request("POST", "/generate", BODY, {"x-padding": "p" * 4096})
    engine_error(exchange(engine.url, raw), 413, "request_too_large")
    with connect(engine.url) as sock:
        sock.sendall(request("POST", "/generate", BODY[:5], length=str(len(BODY))))
        assert "body not received" in engine_error(read_response(sock), 408, "request_timeout")
    with connect(engine.url) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\n")
        assert "head not received" in engine_error(read_response(sock), 408, "request_timeout")
    still_serves(engine)


def test_connection_cap(engine: LocalEngineServer) -> None:
    health = b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n"
    held = [connect(engine.url) for _ in range(3)]
    try:
        for sock in held:
            sock.sendall(health)
            assert read_response(sock).status == 200
        assert "limit of 3 connections" in engine_error(exchange(engine.url, health), 503, "engine_unavailable")
    finally:
        for sock in held:
            sock.close()
    for _ in range(1000):  # the server notices the closes in its own time
        if exchange(engine.url, health).status == 200:
            break
    else:
        raise AssertionError("the engine did not admit a connection after three closed")
