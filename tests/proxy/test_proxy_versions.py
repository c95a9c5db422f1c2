"""Every call on the right policy: an execution runs only where the engine holds the version it was queued
with (or a newer one), and each call records the version its engine reported serving it with."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from gyre.cluster.proxy_node import PlacementGate
from gyre.engine import SyncHttpEngineClient
from gyre.proxy.routing import Router
from tests.proxy.proxy_helpers import Engines, StartProxy
from tests.proxy.test_proxy_redirect import _wait


class _Engine:
    """Router needs engines only to know the cells; no call is made."""

    async def aclose(self) -> None:
        return None


def _router(*cells: str) -> Router:
    return Router({cell: _Engine() for cell in cells})  # type: ignore[misc]


def test_placement_admits_an_execution_only_where_the_engine_holds_its_version() -> None:
    router = _router("a", "b")
    router.set_route("a", 2, admitting=True, version=1)
    router.set_route("b", 1, admitting=True, version=2)
    assert router.place("new-0", 2) == "b"
    assert router.place("new-1", 2) is None  # b is full; a still holds v1
    assert router.admitting(2) == {"b": 0} and router.admitting(1) == {"a": 2, "b": 0}
    assert router.place("old-0", 1) == "a"  # an older execution may run on newer or equal weights
    router.set_route("a", 2, admitting=True, version=2)  # a loaded v2
    assert router.place("new-1", 2) == "a"
    assert router.holds("a", 2) and not router.holds("a", 3)


def test_a_lost_cells_executions_move_only_to_cells_holding_their_version() -> None:
    router = _router("a", "b", "c")
    router.set_route("a", 1, admitting=True, version=2)
    router.set_route("b", 5, admitting=True, version=1)  # the most room, but the old weights
    router.set_route("c", 1, admitting=True, version=2)
    assert router.place("e", 2) == "a"
    assert router.mark_down("a") == {"e": "c"}


def test_the_gate_places_an_execution_once_a_cell_holds_its_version() -> None:
    router = _router("a", "b")
    router.set_route("a", 2, admitting=True, version=1)
    router.set_route("b", 2, admitting=True, version=1)
    gate = PlacementGate(router)
    placed: list[str | None] = []

    def run() -> None:
        assert gate.enter(lambda: False, "e", 2)
        placed.append(gate.place("e"))
        gate.leave()

    worker = threading.Thread(target=run)
    worker.start()
    router.set_route("b", 2, admitting=True, version=2)  # b loaded v2 (a, the lowest id, still holds v1)
    gate.interrupt()
    worker.join(30)
    assert placed == ["b"]


def test_the_gate_places_waiting_executions_in_the_order_they_were_queued() -> None:
    """As the simulator does, whichever harness thread reached the gate (or wakes) first."""
    router = _router("a")
    router.set_route("a", 1, admitting=True, version=0)
    gate = PlacementGate(router)
    gate.expect(["e0", "e1", "e2", "e3"])
    assert gate.enter(lambda: False, "e0", 0) and gate.place("e0") == "a"  # the only slot
    order: list[str] = []
    lock = threading.Lock()

    def run(execution_id: str) -> None:
        assert gate.enter(lambda: False, execution_id, 0)
        with lock:
            order.append(execution_id)
        gate.place(execution_id)

    workers = [threading.Thread(target=run, args=(e,)) for e in ("e3", "e2", "e1")]  # the youngest arrives first
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + 30
    while gate.waiting < 3:
        assert time.monotonic() < deadline, "the three executions never all waited at the gate"
        time.sleep(0.01)
    for done in ("e0", "e1", "e2"):  # each leaves its slot; the oldest waiting execution takes it
        while done not in order and done != "e0":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        router.unpin(done)
        gate.interrupt()
    for worker in workers:
        worker.join(30)
    assert order == ["e1", "e2", "e3"]


def test_the_gate_lets_a_stopping_runner_go_without_placing() -> None:
    router = _router("a")
    router.set_route("a", 2, admitting=True, version=0)
    gate = PlacementGate(router)
    assert not gate.enter(lambda: True, "e", 1)
    assert router.pin_of("e") is None


def _client(url: str, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_call_on_a_cell_that_never_loads_its_version_gets_a_retryable_error(
        two_engines: Engines, start_proxy: StartProxy) -> None:
    a, b, _ = two_engines
    p = start_proxy({"a": a.url, "b": b.url}, weights_wait_s=0.0)
    p.proxy.router.set_route("a", 2, admitting=True, version=0)
    registration = p.server.register_execution("exec-v1", cell_id="a", policy_version=1)
    with pytest.raises(openai.InternalServerError) as raised:
        _client(p.url, registration.token).chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    assert raised.value.status_code == 503
    assert "did not load weights v1" in str(raised.value)
    assert not [e for e in p.events("model_call_finished") if e.execution_id == "exec-v1" and e.output_ids]


def test_a_call_waits_for_its_cell_to_load_the_version_then_records_it(
        two_engines: Engines, start_proxy: StartProxy) -> None:
    a, b, _ = two_engines
    p = start_proxy({"a": a.url, "b": b.url})
    router = p.proxy.router
    router.set_route("a", 2, admitting=True, version=0)
    with SyncHttpEngineClient(a.url) as engine:
        engine.update_weight_version("0")
        registration = p.server.register_execution("exec-v1", cell_id="a", policy_version=1)
        result: dict = {}
        worker = threading.Thread(target=lambda: result.update(reply=_client(p.url, registration.token)
                                                               .chat.completions.create(model="m", messages=MESSAGES,
                                                                                        max_tokens=4)))
        worker.start()
        _wait(lambda: bool(p.proxy._active))  # the call is open and holds (a serves v0)
        engine.update_weight_version("1")  # the cell loaded v1 ...
        router.set_route("a", 2, admitting=True, version=1)  # ... and the controller routed it so
        worker.join(60)
    assert result["reply"].choices[0].finish_reason in ("stop", "length")
    (finished,) = [e for e in p.events("model_call_finished") if e.execution_id == "exec-v1"]
    assert (finished.engine_version, finished.policy_version, finished.cell_id) == (1, 1, "a")


def test_a_call_records_no_served_version_when_the_engine_reports_none(
        two_engines: Engines, start_proxy: StartProxy) -> None:
    a, b, _ = two_engines
    p = start_proxy({"a": a.url, "b": b.url})  # engines named no version: SGLang's "default"
    registration = p.server.register_execution("exec-q", cell_id="a", policy_version=3)
    _client(p.url, registration.token).chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)
    (finished,) = [e for e in p.events("model_call_finished") if e.execution_id == "exec-q"]
    assert finished.engine_version is None and finished.policy_version == 3  # the queue's, marked as such
