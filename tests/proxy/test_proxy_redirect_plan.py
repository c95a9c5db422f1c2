"""A cluster's redirect follows the policy's per-call plan; placement picks the admitting cell with most room."""

from __future__ import annotations

import threading

import openai
from openai.types.chat import ChatCompletion

from gyre.engine import SyncHttpEngineClient
from gyre.proxy.routing import UNPLACED, Router
from tests.conftest import HANG_S
from tests.proxy.proxy_helpers import TOKEN, Engines, StartProxy
from tests.proxy.test_proxy_redirect import MESSAGES, _flights, _wait


class _Engine:
    """Router needs engines only to know the cells; no call is made."""

    async def aclose(self) -> None:
        return None


def _router(*cells: str) -> Router:
    return Router({cell: _Engine() for cell in cells})  # type: ignore[misc]


def test_placement_fills_the_admitting_cell_with_most_free_slots() -> None:
    router = _router("a", "b", "c")
    router.set_route("a", 2, admitting=True)
    router.set_route("b", 1, admitting=True)
    router.set_route("c", 5, admitting=False)  # training: never placed on
    assert [router.place(f"e{i}") for i in range(3)] == ["a", "a", "b"]  # ties go to the lowest id
    assert router.place("e3") is None  # no admitting cell has room
    router.unpin("e0")
    assert router.place("e3") == "a"
    assert router.admitting() == {"a": 0, "b": 0}


def test_repin_plan_follows_the_plan_then_spreads_the_rest() -> None:
    router = _router("a", "b", "c")
    for cell, slots in (("a", 4), ("b", 2), ("c", 3)):
        router.set_route(cell, slots, admitting=True)
    for i in range(4):
        router.pin(f"e{i}", "a")
    router.pin("f0", "c")
    router.set_route("a", 0, admitting=False)
    moved = router.repin_plan("a", {"e2": "b"})
    # e2 where the plan says; the others to the most free cell at each step: b (1 left) vs c (2 left) ...
    assert moved == {"e0": "c", "e1": "b", "e2": "b", "e3": "c"}
    assert all(router.cell_of(e) != "a" for e in moved)


def test_repin_plan_keeps_a_pin_when_no_cell_admits() -> None:
    router = _router("a", "b")
    router.set_route("a", 1, admitting=True)
    router.pin("e0", "a")
    router.set_route("a", 0, admitting=False)
    assert router.repin_plan("a", {}) == {} and router.cell_of("e0") == "a"


def test_an_unplaced_execution_is_refused_a_cell_until_placed(start_proxy: StartProxy, two_engines: Engines) -> None:
    a, b, _ = two_engines
    p = start_proxy({"a": a.url, "b": b.url})
    registration = p.proxy.register_execution("exec-2", cell_id=UNPLACED)
    assert registration.cell_id == UNPLACED
    p.proxy.router.set_route("b", 1, admitting=True)
    assert p.proxy.router.place("exec-2") == "b"


def test_a_redirect_plan_moves_the_named_call_where_the_plan_says(two_engines: Engines,
                                                                   start_proxy: StartProxy) -> None:
    a, b, _ = two_engines
    p = start_proxy({"a": a.url, "b": b.url})  # exec-1 is pinned to a
    router = p.proxy.router
    router.set_route("a", 1, admitting=True)
    router.set_route("b", 1, admitting=True)
    client = openai.OpenAI(base_url=f"{p.url}/v1", api_key=TOKEN, max_retries=0, timeout=HANG_S)
    result: dict[str, ChatCompletion] = {}
    with SyncHttpEngineClient(a.url) as old:
        old.pause("in_place")  # the call waits on a: in flight when the cell leaves
        worker = threading.Thread(target=lambda: result.update(
            reply=client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=8, seed=1)))
        worker.start()
        _wait(lambda: p.server.call(_flights(p.proxy, "a")) > 0)
        (flight,) = router.flights_on("a")
        calls, moved = p.server.call(p.proxy.redirect_plan("a", {flight.call_id: "b"}, {"exec-1": "b"}))
        worker.join(HANG_S)
        old.resume()
    assert (calls, moved) == (1, {"exec-1": "b"})
    assert "a" not in router.admitting()  # the leaving cell admits nothing new
    assert result["reply"].choices[0].finish_reason in ("stop", "length")  # the harness saw no error
    (redirected,) = p.events("call_redirected")
    (finished,) = p.events("model_call_finished")
    assert (redirected.from_cell_id, redirected.to_cell_id) == ("a", "b")
    assert finished.cell_id == "b" and finished.call_id == flight.call_id
