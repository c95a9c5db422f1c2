"""A rollout cell killed mid-call (issue #14): its calls continue on another cell, the harness sees a normal
reply, and the execution's later calls go there too; with no cell to go to the harness gets a retryable error.

Engine A is frozen mid-generation from its scheduler thread, then "crashed": its listening socket closes and
every open connection is reset, as when the process dies. Nothing here races a sleep.
"""

from __future__ import annotations

import threading
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gyre.engine import SyncHttpEngineClient
from gyre.engine.local import LocalEngineServer
from gyre.model.tokenizer import build_tokenizer
from gyre.proxy.core import LOST_REASON
from gyre.proxy.routing import Router
from tests.conftest import HANG_S, Threads
from tests.proxy.proxy_helpers import TOKEN, Engines, Running, StartProxy
from tests.proxy.test_proxy_redirect import _wait

TOKEN2 = "test-token-second-0123456789ab"
MESSAGES = [{"role": "user", "content": "Write a long answer."}]
OTHER = "Tell me a story about the sea."
MAX_TOKENS = 24


def _freeze_when_all_have_tokens(server: LocalEngineServer, monkeypatch: pytest.MonkeyPatch, calls: int,
                                 tokens: int = 2) -> threading.Event:
    """Pause `server`'s engine, from its scheduler thread right after it samples a token, as soon as `calls`
    requests have each sampled `tokens` tokens (streamed or not): they are all mid-generation. The pause is
    queued there and runs before the next step. The event is set once it is frozen."""
    scheduler = server.engine.scheduler
    original = scheduler._sample
    frozen = threading.Event()
    produced: dict[str, int] = {}

    def sample(seq: Any, logits: Any) -> None:
        original(seq, logits)
        if not frozen.is_set():
            produced[seq.req.rid] = len(seq.output_ids)
            if len(produced) == calls and min(produced.values()) >= tokens:
                scheduler.pause("in_place")
                frozen.set()

    monkeypatch.setattr(scheduler, "_sample", sample)
    return frozen


def _crash(server: LocalEngineServer) -> None:
    """Kill `server`'s HTTP side as a dead process would: no new connection is accepted (refused) and every
    open one is reset; its loop then exits without waiting for the requests it was serving."""
    uv = server._server
    assert uv is not None and uv.servers
    loop = uv.servers[0].get_loop()
    done = threading.Event()

    def crash() -> None:
        for listener in uv.servers:
            listener.close()
        for connection in list(uv.server_state.connections):
            connection.transport.abort()  # type: ignore[attr-defined]
        uv.force_exit = True
        uv.should_exit = True
        done.set()

    loop.call_soon_threadsafe(crash)
    assert done.wait(HANG_S), "the engine's loop did not run the crash"
    assert server._thread is not None
    server._thread.join(HANG_S)
    assert not server._thread.is_alive()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)


def _received(p: Running, execution_id: str) -> int:
    """Output tokens the proxy has received from the engine for the execution's call in flight."""
    for call in list(p.proxy._active.values()):
        if call.state.execution_id == execution_id and call._last is not None:
            return len(call._last.output_ids)
    return 0


def _routed(p: Running, **cells: bool) -> Router:
    router = p.proxy.router
    for cell, admitting in cells.items():
        router.set_route(cell, 4, admitting=admitting)
    return router


def test_a_crashed_engine_s_calls_continue_on_another_cell(
    two_engines: Engines, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, seen = two_engines
    p = start_proxy({"a": a.url, "b": b.url})  # exec-1 is pinned to a
    p.server.register_execution("exec-2", TOKEN2, cell_id="a")
    router = _routed(p, a=True, b=True)
    frozen = _freeze_when_all_have_tokens(a, monkeypatch, calls=2)
    oa = openai.OpenAI(base_url=f"{p.url}/v1", api_key=TOKEN, max_retries=0, timeout=HANG_S)
    an = anthropic.Anthropic(base_url=p.url, api_key=TOKEN2, max_retries=0, timeout=HANG_S)
    streamed: list[str] = []
    replies: dict[str, Any] = {}

    def stream() -> None:
        chunks = oa.chat.completions.create(model="m", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
        for chunk in chunks:
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                streamed.append(delta)
            if chunk.choices and chunk.choices[0].finish_reason:
                replies["stream_finish"] = chunk.choices[0].finish_reason

    def whole() -> None:
        replies["whole"] = an.messages.create(model="c", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                              messages=[{"role": "user", "content": OTHER}])

    with SyncHttpEngineClient(a.url) as engine_a:
        engine_a.pause("in_place")  # both calls reach a before either generates
        workers = Threads(stream, whole)
        _wait(lambda: len(seen) == 2 or bool(workers.errors))
        assert not workers.errors, workers.errors
        engine_a.resume()
    assert frozen.wait(HANG_S), "engine a never had both calls mid-generation"
    _wait(lambda: _received(p, "exec-1") >= 2)  # the streamed tokens reached the proxy (on their way out)
    _crash(a)
    workers.join(HANG_S)

    redirects = p.events("call_redirected")
    finished = {c.execution_id: c for c in p.events("model_call_finished")}
    assert len(redirects) == 2 and len(p.events("model_call_finished")) == 2 == len(finished)
    for moved in redirects:
        call = finished[moved.execution_id]
        assert (moved.from_cell_id, moved.to_cell_id, moved.call_id) == ("a", "b", call.call_id)
        assert moved.kv_refused is not None and moved.kv_refused.startswith(LOST_REASON)
        assert moved.tokens_recomputed == len(seen[f"{call.call_id}#1"].input_ids)
        assert call.cell_id == "b" and call.finish_reason in ("stop", "length")
        first, second = seen[f"{call.call_id}#0"], seen[f"{call.call_id}#1"]
        partial = call.output_ids[: moved.tokens_done]
        assert second.input_ids == first.input_ids + partial  # continued from prompt + partial output
        assert call.output_ids == partial + (second.output_ids or [])
        # greedy: the same tokens as a call that never moved (engine b has engine a's weights)
        with SyncHttpEngineClient(b.url) as engine_b:
            reference = engine_b.generate(first.input_ids, {"temperature": 0, "max_new_tokens": MAX_TOKENS})
        assert call.output_ids == reference.output_ids
    stream_move = next(m for m in redirects if m.execution_id == "exec-1")
    assert stream_move.tokens_done >= 1  # moved mid-generation, after tokens the harness was shown
    assert redirects[0].execution_id != redirects[1].execution_id

    assert replies["stream_finish"] in ("stop", "length") and replies["whole"].stop_reason in ("end_turn",
                                                                                              "max_tokens")
    stream_call = finished["exec-1"]
    tokenizer = build_tokenizer()
    visible = stream_call.output_ids
    if replies["stream_finish"] == "stop" and visible and visible[-1] in tokenizer.all_special_ids:
        visible = visible[:-1]  # the stop token that ended the reply is recorded, but it is not text
    assert "".join(streamed) == tokenizer.decode(visible)  # one uninterrupted reply: nothing twice, no gap
    if replies["stream_finish"] == "length":
        assert len(stream_call.output_ids) == MAX_TOKENS
    assert replies["whole"].usage.output_tokens == len(finished["exec-2"].output_ids)

    # a is down: it admits nothing, and both executions now live on b; their next calls go there
    assert router.is_down("a") and "a" not in router.admitting()
    assert router.cell_of("exec-1") == router.cell_of("exec-2") == "b"
    again = oa.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert again.choices[0].finish_reason in ("stop", "length")
    started = p.events("model_call_started")
    assert [c.cell_id for c in started] == ["a", "a", "b"] and p.events("model_call_finished")[-1].cell_id == "b"
    assert len(p.events("call_redirected")) == 2


def test_without_a_controller_the_call_moves_to_another_engine(
    two_engines: Engines, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy with a fixed set of engines (no routing updates) moves the call to the least loaded live one."""
    a, b, seen = two_engines
    p = start_proxy({"a": a.url, "b": b.url})
    frozen = _freeze_when_all_have_tokens(a, monkeypatch, calls=1, tokens=1)
    client = anthropic.Anthropic(base_url=p.url, api_key=TOKEN, max_retries=0, timeout=HANG_S)
    texts: list[str] = []

    def consume() -> None:
        with client.messages.stream(model="c", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": OTHER}]) as events:
            texts.extend(events.text_stream)

    worker = Threads(consume)
    assert frozen.wait(HANG_S)
    _crash(a)
    worker.join(HANG_S)
    (moved,) = p.events("call_redirected")
    (call,) = p.events("model_call_finished")
    assert (moved.from_cell_id, moved.to_cell_id, call.cell_id) == ("a", "b", "b")
    assert moved.kv_refused is not None and moved.kv_refused.startswith(LOST_REASON)
    assert call.output_ids[: moved.tokens_done] + (seen[f"{call.call_id}#1"].output_ids or []) == call.output_ids
    assert texts and p.proxy.router.cell_of("exec-1") == "b"


def test_with_no_admitting_cell_the_harness_gets_a_retryable_error(
    two_engines: Engines, start_proxy: StartProxy
) -> None:
    a, b, seen = two_engines
    p = start_proxy({"a": a.url, "b": b.url}, engine_lost_wait_s=0.3)
    p.server.register_execution("exec-2", TOKEN2, cell_id="a")
    router = _routed(p, a=True, b=False)  # b trains: nowhere to go
    result: dict[str, Any] = {}

    def call() -> None:
        with httpx.Client(base_url=p.url, timeout=HANG_S) as http:
            result["anthropic"] = http.post("/v1/messages", headers={"x-api-key": TOKEN}, json={
                "model": "c", "max_tokens": 8, "messages": [{"role": "user", "content": OTHER}]})

    with SyncHttpEngineClient(a.url) as engine_a:
        engine_a.pause("in_place")  # the call waits on a when it dies
        worker = Threads(call)
        _wait(lambda: len(seen) == 1)
    _crash(a)
    worker.join(HANG_S)
    reply = result["anthropic"]
    assert reply.status_code == 529 and reply.json()["error"]["type"] == "overloaded_error"
    assert "no other cell admitted" in reply.json()["error"]["message"]
    with httpx.Client(base_url=p.url, timeout=HANG_S) as http:  # a later call of another execution on a: the same
        reply = http.post("/v1/chat/completions", headers={"authorization": f"Bearer {TOKEN2}"},
                          json={"model": "m", "max_tokens": 8, "messages": MESSAGES})
    assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
    with httpx.Client(base_url=p.url, timeout=HANG_S) as http, http.stream(  # a stream has said 200 already
        "POST", "/v1/messages", headers={"x-api-key": TOKEN},
        json={"model": "c", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": OTHER}]},
    ) as streamed:
        events = streamed.read().decode()
    assert streamed.status_code == 200 and "event: error" in events and "overloaded_error" in events
    assert not p.events("call_redirected")
    assert len(p.events("model_call_started")) == 3
    finished = p.events("model_call_finished")
    assert [c.finish_reason for c in finished] == ["abort"] * 3 and len({c.call_id for c in finished}) == 3
    assert router.is_down("a") and router.admitting() == {}
    assert [s.output_ids for s in seen.values()] == [None]  # b was never asked


def test_a_call_waiting_for_a_cell_continues_when_the_controller_routes_one(
    two_engines: Engines, start_proxy: StartProxy
) -> None:
    a, b, seen = two_engines
    p = start_proxy({"a": a.url, "b": b.url}, engine_lost_wait_s=600)
    router = _routed(p, a=True, b=False)
    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key=TOKEN, max_retries=0, timeout=HANG_S)
    result: dict[str, Any] = {}
    with SyncHttpEngineClient(a.url) as engine_a:
        engine_a.pause("in_place")
        worker = Threads(lambda: result.update(
            reply=client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8)))
        _wait(lambda: len(seen) == 1)
    _crash(a)
    _wait(lambda: router.is_down("a"))
    router.set_route("a", 4, admitting=True)  # a stale table (sent before the loss was known): a stays down
    assert "a" not in router.admitting()
    router.set_route("b", 4, admitting=True)  # b returns to rollout: the waiting call goes there
    worker.join(HANG_S)
    assert result["reply"].choices[0].finish_reason in ("stop", "length")
    (moved,) = p.events("call_redirected")
    (call,) = p.events("model_call_finished")
    assert (moved.from_cell_id, moved.to_cell_id, moved.tokens_done, call.cell_id) == ("a", "b", 0, "b")


def test_an_engine_s_4xx_is_still_the_harness_s_error(engine_server: LocalEngineServer,
                                                      start_proxy: StartProxy) -> None:
    limit = engine_server.engine.runner.max_positions
    p = start_proxy({"cell0": engine_server.url}, context_length=limit * 4)  # the engine refuses it, not us
    long_prompt = [{"role": "user", "content": "x " * limit}]
    with httpx.Client(base_url=p.url, timeout=HANG_S) as http:
        reply = http.post("/v1/chat/completions", headers={"authorization": f"Bearer {TOKEN}"},
                          json={"model": "m", "max_tokens": 8, "messages": long_prompt})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    assert "exceed the context length" in reply.json()["error"]["message"]
    assert not p.events("call_redirected") and not p.proxy.router.is_down("cell0")


# -- the router's down marks ---------------------------------------------------------------------------------


class _Engine:
    def __init__(self, url: str = "http://x") -> None:
        self.base_url = url

    async def aclose(self) -> None:
        return None


def test_a_down_cell_admits_nothing_until_the_controller_routes_it_again() -> None:
    router = Router({c: _Engine() for c in "abc"})  # type: ignore[misc]
    for cell, slots in (("a", 2), ("b", 2), ("c", 3)):
        router.set_route(cell, slots, admitting=True)
    router.pin("e0", "a")
    router.pin("e1", "a")
    router.pin("f0", "c")
    changes: list[int] = []
    unwatch = router.watch(lambda: changes.append(1))
    assert router.mark_down("a") == {"e0": "b", "e1": "c"}  # most free slots, lowest id among equals
    assert router.admitting() == {"b": 1, "c": 1} and changes
    assert router.relocate("e0") == "b"  # its pin is live
    router.set_route("a", 2, admitting=True)  # stale: still down
    assert "a" not in router.admitting() and router.is_down("a")
    router.set_route("a", 0, admitting=False)  # the controller took it out...
    router.set_route("a", 2, admitting=True)  # ... and re-added it
    assert not router.is_down("a") and router.admitting()["a"] == 2
    router.mark_down("b")
    router.add_cell("b", _Engine("http://restarted"))  # a restarted cell's new engine
    assert not router.is_down("b")
    unwatch()
    count = len(changes)
    router.unpin("e0")
    assert len(changes) == count


def test_an_execution_on_a_down_cell_waits_when_no_cell_admits() -> None:
    engine = _Engine()
    router = Router({"a": engine, "b": _Engine()})  # type: ignore[dict-item]
    router.set_route("a", 1, admitting=True)
    router.pin("e0", "a")
    assert router.mark_down("a", _Engine()) == {} and not router.is_down("a")  # not a's engine: ignored
    assert router.mark_down("a", engine) == {} and router.cell_of("e0") == "a"  # nowhere to go: it stays
    assert router.relocate("e0") is None
    router.set_route("b", 1, admitting=True)
    assert router.relocate("e0") == "b" and router.cell_of("e0") == "b"
