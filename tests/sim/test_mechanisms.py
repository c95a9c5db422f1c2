"""The load- and layout-dependent costs: decode curve, shared migrations, shared core link, all-reduce, cell size."""

import itertools

import pytest

from gyre.sim.clock import Agenda, to_us
from gyre.sim.rollouts import DecodeCurve, shared_transfer_s
from gyre.sim.runner import simulate
from gyre.sim.scenario import load_scenario, with_values
from gyre.sim.training import SharedLink
from gyre.sim.workload import sample_workload
from gyre.sink import MemorySink

CURVE = {"decode.share": 0.5, "decode.step_ms": 10.0, "decode.per_request_ms": 1.0, "decode.per_mtoken_ms": 5.0,
         "decode.reference_context_tokens": 50_000}


def test_the_decode_curve_is_one_at_the_reference_and_falls_with_the_batch():
    sc = with_values(load_scenario("tiny"), CURVE)
    curve, slots = DecodeCurve(sc), sc.cluster.slots_per_cell
    assert curve.rate(slots, slots * 50_000) == pytest.approx(1.0)
    rates = [curve.rate(n, n * 50_000) for n in range(1, slots + 1)]
    assert all(a > b for a, b in itertools.pairwise(rates))  # per-request speed falls as the batch grows
    assert curve.rate(1, 0) < 1 / (1 - 0.5)  # never faster than the decode share allows
    assert DecodeCurve(load_scenario("tiny")).rate(1, 0) == 1.0  # share 0: load-independent


def test_migrations_out_of_one_cell_share_its_egress():
    assert shared_transfer_s([10.0, 20.0], per_flow=10.0, total=None) == [1.0, 2.0]
    # 4 equal flows on a 20 B/s link capped at 10 B/s each: 5 B/s each, all done at 4 s
    assert shared_transfer_s([20.0] * 4, per_flow=10.0, total=20.0) == [4.0] * 4
    # 5 B/s each until the small one is done at 4 s; the big one's last 20 B then take 2 s at the full link
    assert shared_transfer_s([40.0, 20.0], per_flow=10.0, total=10.0) == [6.0, 4.0]


class _Clocked:
    def __init__(self) -> None:
        self.agenda, self.now = Agenda(), 0

    def run(self) -> None:
        while (due := self.agenda.next_due()) is not None:
            self.now = due
            while (action := self.agenda.pop_due(due)) is not None:
                action()


def test_transfers_on_the_core_link_share_it():
    sim, took = _Clocked(), {}
    link = SharedLink(sim)  # type: ignore[arg-type]
    link.start(10.0, lambda s: took.setdefault("a", (s, sim.now)))
    sim.agenda.at(to_us(5.0), lambda: link.start(10.0, lambda s: took.setdefault("b", (s, sim.now))))
    sim.run()
    # a runs alone for 5 s, then both at half speed: a's last 5 s take 10 s (done at 15 s), b then finishes
    assert took["a"] == pytest.approx((15.0, to_us(15.0)), abs=1e-3)
    assert took["b"] == pytest.approx((15.0, to_us(20.0)), abs=1e-3)


def test_a_lighter_cell_decodes_faster_than_the_sampled_full_cell_pace():
    sc = with_values(load_scenario("tiny"), {**CURVE, "decode.per_mtoken_ms": 0.0})
    sink = MemorySink()
    simulate(sc, "colocate", steps=1, sink=sink)  # colocate never redirects: no migration pauses
    sampled = {e.execution_id: e.duration_s for e in sample_workload(sc, sc.seed, 1).executions()}
    recorded = {e.execution_id: e.duration_s for e in sink.events if e.kind == "execution_finished"}
    assert all(recorded[x] <= sampled[x] + 1e-5 * 8 for x in recorded)
    assert sum(recorded.values()) < 0.95 * sum(sampled.values())


def test_the_optimizer_all_reduces_over_the_cells_that_trained():
    sc = with_values(load_scenario("tiny"), {"training.gradient_sync_s": 100.0})
    sink = MemorySink()
    simulate(sc, "elastic", sink=sink)
    last_micro, cells = {}, {}
    for e in sink.events:
        if e.kind == "micro_step_finished":
            last_micro[e.step] = e.ts
            cells.setdefault(e.step, set()).add(e.cell_id)
        elif e.kind == "train_step_finished":
            k = len(cells[e.step])
            expected = sc.training.optimizer_s + 100.0 * 2 * (k - 1) / k
            assert (e.ts - last_micro[e.step]).total_seconds() == pytest.approx(expected, abs=1e-5)
    assert any(len(c) > 1 for c in cells.values())


def test_training_time_scales_with_the_cell_size():
    training = load_scenario("tiny").training.model_copy(update={"reference_gpus": 16})
    assert training.cell_s_per_mtoken(16) == training.s_per_mtoken
    assert training.cell_s_per_mtoken(32) == training.s_per_mtoken / 2
    assert training.model_copy(update={"scaling_exponent": 0.5}).cell_s_per_mtoken(64) == training.s_per_mtoken / 2


def test_the_decode_curve_fit_recovers_known_terms_and_never_goes_negative():
    import numpy as np

    from benchmarks.decode_curve import fit_relative

    design = np.array([[1.0, n, n * c / 1e6] for n in (1, 4, 16) for c in (64, 4096)])
    assert fit_relative(design, design @ np.array([0.7, 0.16, 178.0])) == pytest.approx([0.7, 0.16, 178.0])
    # a curve that would need a negative fixed cost gets none, and the other terms absorb it
    coef = fit_relative(design, design @ np.array([-0.5, 0.3, 200.0]) + 0.6)
    assert (coef >= 0).all()
