"""Redirect in the middle of a call: the old engine aborts it, the new one continues from the partial output,
the harness sees one uninterrupted reply, and the log has a `call_redirected` event."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion

from gyre.engine import SyncHttpEngineClient
from gyre.engine.local import LocalEngineServer
from gyre.model.tokenizer import build_tokenizer
from gyre.proxy import Proxy
from tests.conftest import HANG_S, Threads
from tests.proxy.proxy_helpers import TOKEN, Engines, StartProxy

MESSAGES = [{"role": "user", "content": "Write a long answer."}]
SEED = 11  # the seed-0 tiny model samples 64 tokens for this prompt and seed without an end-of-turn


def _wait(predicate: Callable[[], bool], timeout_s: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _freeze_after_first_token(server: LocalEngineServer, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Pause `server`'s engine right after it emits the first streamed token of a call, from its scheduler
    thread: the pause is queued there and runs before the next decode step, so the call is mid-generation
    with exactly one token done, however fast or loaded the machine. The event is set once it is frozen."""
    scheduler = server.engine.scheduler
    original = scheduler.submit
    frozen = threading.Event()

    def submit(request: Any) -> Any:
        inner = request.sink

        def sink(out: Any) -> None:
            if not frozen.is_set() and not out.finished and out.output_ids:
                scheduler.pause("in_place")
                frozen.set()
            inner(out)

        return original(dataclasses.replace(request, sink=sink))

    monkeypatch.setattr(scheduler, "submit", submit)
    return frozen


def test_redirect_mid_stream_continues_on_the_new_engine(
    two_engines: Engines, start_proxy: StartProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, seen = two_engines
    p = start_proxy({"a": a.url, "b": b.url})
    assert p.registration.cell_id == "a"
    frozen = _freeze_after_first_token(a, monkeypatch)
    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key=TOKEN, max_retries=0, timeout=HANG_S)
    text: list[str] = []

    def consume() -> None:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=64, seed=SEED, stream=True)
        for chunk in stream:
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                text.append(delta)

    consumer = Threads(consume)
    assert frozen.wait(HANG_S), "engine a never streamed a token"
    assert p.server.redirect("a", ["b"]) == {"exec-1": "b"}  # the old engine is frozen mid-generation
    with SyncHttpEngineClient(a.url) as old:
        old.resume()
    consumer.join(HANG_S)
    redirects = p.events("call_redirected")
    finished = p.events("model_call_finished")
    assert len(redirects) == 1 and len(finished) == 1
    moved, call = redirects[0], finished[0]
    assert (moved.from_cell_id, moved.to_cell_id, moved.call_id) == ("a", "b", call.call_id)
    first, second = seen[f"{call.call_id}#0"], seen[f"{call.call_id}#1"]
    partial = first.output_ids
    assert len(partial) == 1 and moved.tokens_done == 1  # frozen right after its first token
    assert second.input_ids == first.input_ids + partial  # the new engine continues from the partial output
    assert call.output_ids == partial + second.output_ids and call.cell_id == "b"
    assert len(call.output_logprobs) == len(call.output_ids) <= 64
    tokenizer = build_tokenizer()
    visible = call.output_ids
    if call.finish_reason == "stop" and visible and visible[-1] in tokenizer.all_special_ids:
        visible = visible[:-1]  # the stop token that ended the reply is recorded, but it is not text
    assert "".join(text) == tokenizer.decode(visible)
    assert p.proxy.router.cell_of("exec-1") == "b"


def _redirect_while_waiting(p: Any, engine_url: str, redirect: Callable[[], object]) -> tuple[ChatCompletion, object]:
    """A call waiting on a paused engine (its flight registered on cell ``a``) when ``redirect()`` runs; the
    harness's reply and what ``redirect`` returned."""
    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key=TOKEN, max_retries=0, timeout=HANG_S)
    result: dict[str, ChatCompletion] = {}
    with SyncHttpEngineClient(engine_url) as old:
        old.pause("in_place")
        worker = threading.Thread(
            target=lambda: result.update(
                reply=client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, seed=1)
            )
        )
        worker.start()
        _wait(lambda: p.server.call(_flights(p.proxy, "a")) > 0)
        answer = redirect()
        worker.join(HANG_S)
        old.resume()
    return result["reply"], answer


def test_redirect_of_a_waiting_call(two_engines: Engines, start_proxy: StartProxy) -> None:
    a, b, seen = two_engines
    p = start_proxy({"a": a.url, "b": b.url})
    reply, _ = _redirect_while_waiting(p, a.url, lambda: p.server.redirect("a", ["b"]))
    assert reply.choices[0].finish_reason in ("stop", "length")
    (moved,) = p.events("call_redirected")
    (call,) = p.events("model_call_finished")
    assert moved.tokens_done == 0 and call.cell_id == "b"
    assert seen[f"{call.call_id}#1"].input_ids == seen[f"{call.call_id}#0"].input_ids


async def _flights(proxy: Proxy, cell: str) -> int:
    return len(proxy.router.flights_on(cell))


def test_a_planned_redirect_moves_a_call_whose_execution_the_proxy_holds_no_pin_for(
    two_engines: Engines, start_proxy: StartProxy
) -> None:
    """Chaos seed 8 with bursts: the policy planned a redirect on the log's view while a restarted proxy held
    no pin for one execution in flight there. Its call continues on a cell that admits (pinned there), not a
    fatal 'not placed on any cell' that ended the run."""
    a, b, _ = two_engines
    p = start_proxy({"a": a.url, "b": b.url})

    def planned_redirect() -> object:
        p.proxy.router._pins.pop("exec-1")  # the proxy's pin is gone (as after its restart)
        p.proxy.router.set_route("b", 2, admitting=True)  # the cluster's routing: b admits
        return p.server.call(p.proxy.redirect_plan("a", {}, {}))

    reply, (calls, moved) = _redirect_while_waiting(p, a.url, planned_redirect)
    assert calls == 1 and moved == {}
    assert reply.choices[0].finish_reason in ("stop", "length")
    (redirected,) = p.events("call_redirected")
    (call,) = p.events("model_call_finished")
    assert (redirected.from_cell_id, redirected.to_cell_id, call.cell_id) == ("a", "b", "b")
    assert p.proxy.router.pin_of("exec-1") == "b"
