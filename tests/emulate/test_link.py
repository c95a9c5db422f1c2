"""The core's link (`gyre.emulate.link`): transfers in flight share it equally, in the simulator's arithmetic
and on the wall clock of a live emulated cell."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.emulate import Accelerator, Emulation, Pacer
from gyre.emulate.link import FairShare, SharedLink


def finish_times(works: list[float]) -> dict[int, float]:
    """Drive a `FairShare` whose transfers all start at 0 until every one is through."""
    share, now, done = FairShare(0.0), 0.0, {}
    for key, work in enumerate(works):
        share.add(key, work, 0.0)
    while (step := share.until_next()) is not None:
        now += step
        share.advance(now)
        for key in share.pop_finished(1e-9 * max(works)):
            done[key] = now
    return done


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.01, max_value=100.0), min_size=1, max_size=12))
def test_transfers_started_together_finish_as_processor_sharing_has_them(works: list[float]) -> None:
    """The k-th shortest of n finishes at the sum of the k shortest plus (n - k) times its own work: every
    transfer in flight gets an equal share, and the link is never idle while one is (the last ends at the sum)."""
    done = finish_times(works)
    ordered = sorted(range(len(works)), key=lambda k: works[k])
    n = len(works)
    for rank, key in enumerate(ordered, start=1):
        expected = sum(works[j] for j in ordered[:rank]) + (n - rank) * works[key]
        assert done[key] == pytest.approx(expected, rel=1e-6)
    assert max(done.values()) == pytest.approx(sum(works), rel=1e-6)


def test_a_transfer_arriving_later_slows_the_one_in_flight() -> None:
    share = FairShare(0.0)
    share.add("a", 10.0, 0.0)
    share.add("b", 10.0, 5.0)  # a ran alone for 5: 5 left, now at half speed
    assert share.until_next() == pytest.approx(10.0)
    share.advance(15.0)
    assert share.pop_finished(1e-9) == ["a"] and share.remaining["b"] == pytest.approx(5.0)


def test_two_transfers_begun_together_on_the_wall_clock_each_take_both_times() -> None:
    """Lower bounds only: a loaded machine can only make them later."""
    link, alone, took = SharedLink(), 0.15, {}
    tickets = {name: link.begin(alone) for name in ("a", "b")}
    threads = [threading.Thread(target=lambda n=name: took.setdefault(n, link.wait(tickets[n]))) for name in tickets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert set(took) == {"a", "b"} and all(t >= 2 * alone - SharedLink.TOLERANCE_S * 4 for t in took.values())
    assert link.in_flight == 0


def test_real_work_done_for_a_transfer_counts_as_transferred() -> None:
    link = SharedLink()
    started = time.perf_counter() - 1.0  # a second of real work already behind it, against 0.5 s alone
    assert link.transfer(0.5, started) >= 1.0 and link.in_flight == 0


ACCEL = dict(step_ms=30, per_request_ms=1.6, per_mtoken_ms=16.64, prefill_s_per_mtoken=30, train_s_per_mtoken=50,
             optimizer_s=15, publish_s=15, satellite_join_s=7.5, to_training_s=2.13, to_rollout_s=0.865)


def test_a_pacer_without_a_shared_link_holds_a_transfer_as_any_other_work() -> None:
    now, slept = [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    pacer = Pacer(Emulation(accelerator=Accelerator(**ACCEL), time_scale=10), sleep=sleep, clock=lambda: now[0])
    assert pacer.link is None
    assert pacer.transfer(0.0, 7.5) == pytest.approx(0.75) and slept == [pytest.approx(0.75)]


def test_a_pacer_with_a_shared_link_counts_what_the_link_made_of_a_transfer() -> None:
    pacer = Pacer(Emulation(accelerator=Accelerator(**ACCEL, share_core_link=True), time_scale=100))
    assert pacer.link is not None
    started = pacer.clock()
    waited = pacer.transfer(started, 7.5)  # 0.075 s of wall time alone
    s = pacer.snapshot()
    assert waited >= 0.075 - 1e-3 and s["holds"] == 1 and s["emulated_s"] >= 7.5 - 0.1
