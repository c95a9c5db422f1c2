"""Engine clients: one conformance suite for the async and sync HTTP clients, plus their error taxonomy."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from typer.testing import CliRunner

from gyre.engine import (
    EngineClient,
    EngineHTTPError,
    EngineProtocolError,
    EngineTimeoutError,
    EngineUnreachableError,
    HttpEngineClient,
    SamplingParams,
    SyncHttpEngineClient,
)
from gyre.engine.client import EngineClientConfig, generate_body, parse_generate
from gyre.engine.local import LocalEngineServer
from gyre.model import build_tiny_model
from tests.conftest import HANG_S, refused_url


def test_async_client_conforms(server: LocalEngineServer, prompt) -> None:
    async def scenario() -> None:
        async with HttpEngineClient(server.url) as c:
            assert isinstance(c, EngineClient)
            assert await c.health()
            assert (await c.model_info()).is_generation
            ids = prompt("async")
            greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
            r = await c.generate(ids, greedy, rid="r1", routing_key="session-1")
            assert r.rid == "r1" and len(r.output_ids) == 8 and r.latency > 0 and r.e2e_latency is not None
            chunks = [chunk async for chunk in c.generate_stream(ids, greedy)]
            assert chunks[-1].output_ids == r.output_ids and chunks[-1].finished
            # abort through the client while a generation is in flight (held there until the abort lands)
            long = SamplingParams(temperature=0.0, max_new_tokens=5000, ignore_eos=True)
            held = server.engine.scheduler.hold(1)
            task = asyncio.ensure_future(c.generate(ids, long, rid="long"))
            assert await asyncio.to_thread(held.wait, HANG_S)
            await c.abort("long")
            server.engine.scheduler.release_hold()
            aborted = await task
            assert aborted.finish_reason is not None and aborted.finish_reason.type == "abort"
            await c.pause("in_place")
            await c.resume()
            await c.flush_cache()
            resp = await c.update_weights_from_tensor(dict(build_tiny_model(9).named_parameters()), "v9")
            assert resp.success and (await c.generate(ids, greedy)).weight_version == "v9"

    asyncio.run(scenario())


def test_sync_client_conforms(server: LocalEngineServer, prompt) -> None:
    with SyncHttpEngineClient(server.url) as c:
        assert c.health() and c.model_info().weight_version == "default"
        ids = prompt("sync")
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        r = c.generate(ids, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})  # a plain mapping works
        assert r.output_ids == c.generate(ids, greedy).output_ids
        assert list(c.generate_stream(ids, greedy))[-1].output_ids == r.output_ids
        c.pause("in_place")
        c.resume()
        c.flush_cache()
        c.abort("nothing-by-this-name")


def test_unreachable_engine_raises_clearly() -> None:
    with refused_url() as url:
        with SyncHttpEngineClient(url) as c:
            with pytest.raises(EngineUnreachableError, match="unreachable") as e:
                c.generate([1, 2, 3])
            assert url in str(e.value)
            assert c.health() is False

        async def go() -> None:
            async with HttpEngineClient(url) as c:
                with pytest.raises(EngineUnreachableError):
                    await c.model_info()

        asyncio.run(go())


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A socket that accepts connections (via the backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_engine_that_never_answers_times_out(silent_server: str) -> None:
    config = EngineClientConfig(base_url=silent_server, generate_timeout_s=0.3, control_timeout_s=0.3)
    with SyncHttpEngineClient(config) as c:
        start = time.monotonic()
        with pytest.raises(EngineTimeoutError, match=r"did not answer within 0\.3"):
            c.generate([1, 2])
        assert time.monotonic() - start < 5


def test_http_error_carries_status_and_body(server: LocalEngineServer) -> None:
    with SyncHttpEngineClient(server.url) as c, pytest.raises(EngineHTTPError) as e:
        c.generate([1, 2], {"top_k": 0})
    assert e.value.status == 400 and "sampling_params.top_k" in e.value.body


def test_parses_a_real_sglang_shaped_response() -> None:
    """SGLang adds fields (reasoning_tokens, num_retractions, ...) and abort reasons carry extra keys."""
    data = {
        "text": "hi",
        "output_ids": [5, 6],
        "meta_info": {
            "id": "abc",
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue", "status_code": 400},
            "prompt_tokens": 3,
            "completion_tokens": 2,
            "cached_tokens": 1,
            "reasoning_tokens": 0,
            "num_retractions": 0,
            "weight_version": "default",
            "e2e_latency": 0.01,
            "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]],
            "output_token_logprobs_length": 2,
        },
    }
    r = parse_generate(data, "abc", 0.02)
    assert r.output_ids == [5, 6] and r.output_logprobs == [-0.5, -1.5]
    assert r.finish_reason is not None and r.finish_reason.type == "abort" and r.cached_tokens == 1
    with pytest.raises(EngineProtocolError):
        parse_generate({"text": "x"}, "abc", 0.0)
    with pytest.raises(EngineProtocolError, match="finish_reason"):
        parse_generate({"meta_info": {"id": "abc"}}, "abc", 0.0)


def test_generate_body_sends_only_what_was_set() -> None:
    body = generate_body([1, 2], SamplingParams(temperature=0.5), "rid", True)
    assert body == {"input_ids": [1, 2], "sampling_params": {"temperature": 0.5}, "rid": "rid", "return_logprob": True}
    with pytest.raises(ValueError, match="base_url"):
        EngineClientConfig(base_url="localhost:30000")


def test_cli_serves_the_tiny_model() -> None:
    from gyre.engine.cli import engine_app

    help_text = CliRunner().invoke(engine_app, ["serve", "--help"]).output
    assert "--model" in help_text and "--port" in help_text and "--kv-pool-tokens" in help_text
    refused = CliRunner().invoke(engine_app, ["serve", "--kv-pool-tokens", "-1"])
    assert refused.exit_code == 2 and "--kv-pool-tokens" in refused.output
    code = "from gyre.engine.cli import engine_app; engine_app()"
    proc = subprocess.Popen(  # port 0: the engine binds a free port and prints its URL (no port probed before)
        [sys.executable, "-c", code, "serve", "--model", "tiny", "--port", "0", "--seed", "0",
         "--kv-pool-tokens", "4096"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        announced = proc.stdout.readline()
        assert announced.startswith("gyre engine: serving on http://127.0.0.1:"), announced
        url = announced.split()[-1]
        deadline = time.monotonic() + HANG_S
        with SyncHttpEngineClient(url) as c:
            while not c.health():
                assert proc.poll() is None, "engine process exited"
                assert time.monotonic() < deadline, "engine did not come up"
                time.sleep(0.2)
            assert c.model_info().model_path == "tiny"
            assert c.generate([1, 2, 3], {"max_new_tokens": 3}).completion_tokens == 3
        pool = httpx.get(url + "/gyre/stats").json()["kv_pool"]
        assert (pool["pages"], pool["page_size"]) == (4096 // 16, 16)  # the flag sized the import pool
    finally:
        proc.terminate()
        proc.communicate(timeout=HANG_S)


def test_client_package_does_not_import_torch() -> None:
    """The proxy imports `gyre.engine`; it must stay light (no torch, no transformers)."""
    code = "import sys, gyre.engine; print('torch' in sys.modules or 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
