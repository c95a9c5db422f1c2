"""Partial rollouts in the proxy's router (`Router.cut`): a cut execution releases its slot, is placed again
only on a cell holding the version it was cut with, and before any execution not yet placed."""

from __future__ import annotations

from gyre.proxy.routing import Router


class _Engine:
    """Router needs engines only to know the cells; no call is made."""

    async def aclose(self) -> None:
        return None


def test_a_cut_execution_frees_its_slot_and_is_placed_first_on_a_cell_with_its_version() -> None:
    router = Router({cell: _Engine() for cell in ("a", "b")})  # type: ignore[misc]
    router.set_route("a", 1, admitting=True, version=0)
    router.set_route("b", 1, admitting=True, version=0)
    assert [router.place("e0"), router.place("e1")] == ["a", "b"]
    router.set_route("a", 0, admitting=False)  # a leaves rollout
    router.cut("e0", version=1)
    assert router.pin_of("e0") is None and router.is_cut("e0") and router.pinned_on("a") == []
    assert router.place_cut("e0") is None  # b is full (and holds v0)
    router.unpin("e1")  # e1 ends: b has a slot, but still v0
    assert router.place_cut("e0") is None
    assert router.place("new", 0) == "b"  # no cut execution fits anywhere yet: a new one may take the slot
    router.unpin("new")
    router.set_route("b", 1, admitting=True, version=1)  # b loads v1
    assert router.place("new", 0) is None  # the cut execution fits now: it goes first
    assert router.place_cut("e0") == "b" and not router.is_cut("e0")
    assert router.need("e0") == 1
