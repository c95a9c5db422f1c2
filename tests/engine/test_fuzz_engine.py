"""Fuzzing the local engine's native API (`/generate`, abort, pause/continue, weight updates): whatever
the body, never a server error (5xx), and every error a JSON `{"error": {"message", "type", ...}}`."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
from tests.fuzz_helpers import FUZZ, bodies

MAX_NEW_TOKENS = 4
"""Fuzzed requests that are valid still generate; a long generation is no finding, only a slow test."""

ENDPOINTS: dict[str, dict[str, Any]] = {
    "/generate": {"input_ids": [1, 2, 3], "rid": "r", "return_logprob": True, "stream": False,
                  "sampling_params": {"max_new_tokens": 2, "temperature": 1.0, "top_p": 0.9, "top_k": 5,
                                      "stop": ["x"], "stop_token_ids": [7], "ignore_eos": False,
                                      "sampling_seed": 1}},
    "/abort_request": {"rid": "r", "abort_all": False},
    "/pause_generation": {"mode": "in_place"},
    "/continue_generation": {"torch_empty_cache": False},
    "/update_weights_from_disk": {"model_path": "/nonexistent", "load_format": "safetensors",
                                  "flush_cache": True},
    "/update_weights_from_tensor": {"serialized_named_tensors": [base64.b64encode(b"not safetensors").decode()],
                                    "load_format": "safetensors", "weight_version": "v"},
}


@pytest.fixture(scope="module")
def engine() -> Iterator[LocalEngineServer]:
    server = LocalEngineServer(LocalEngine(LocalEngineConfig(seed=0)))
    server.start()
    yield server
    server.stop()


def bounded(body: bytes) -> bytes:
    """`body` with every `max_new_tokens` above `MAX_NEW_TOKENS` lowered to it (and one set where absent)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if isinstance(data, dict):
        params = data.setdefault("sampling_params", {"max_new_tokens": MAX_NEW_TOKENS})
        for p in params if isinstance(params, list) else [params]:
            if isinstance(p, dict):
                n = p.setdefault("max_new_tokens", MAX_NEW_TOKENS)
                if isinstance(n, int | float) and not isinstance(n, bool) and n > MAX_NEW_TOKENS:
                    p["max_new_tokens"] = MAX_NEW_TOKENS
    return json.dumps(data).encode()


def assert_typed(path: str, response: httpx.Response) -> None:
    assert response.status_code < 500 or response.status_code == 503, (path, response.status_code, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), error


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_fuzz_bodies(engine: LocalEngineServer, path: str) -> None:
    with httpx.Client(base_url=engine.url, timeout=120) as http:

        @FUZZ
        @given(bodies(ENDPOINTS[path]))
        def check(body: bytes) -> None:
            try:
                with http.stream("POST", path, content=bounded(body) if path == "/generate" else body) as response:
                    response.read()
                assert_typed(path, response)
            finally:
                if path == "/pause_generation":
                    http.post("/continue_generation")  # a paused engine would hold every later generate

        check()
        assert http.post("/generate", json=ENDPOINTS["/generate"]).status_code == 200  # still serving


@FUZZ
@given(path=st.sampled_from([*ENDPOINTS, "/get_model_info", "/health", "/flush_cache", "/nope"]),
       method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]))
def test_fuzz_methods(engine: LocalEngineServer, path: str, method: str) -> None:
    response = httpx.request(method, engine.url + path, content=b"{}", timeout=60)
    assert_typed(path, response)
    if response.status_code >= 400:
        assert response.json()["error"]["type"]
