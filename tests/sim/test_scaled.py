"""Scaled scenarios (issue #26, deliverable 5): at least 8 cells of proportionally smaller capacity, fewer and
shorter executions, a few steps, and the original's policy ranking and speedups within 5% in full simulation.

The originals' figures are the shipped ones (``docs/simulator.md``, seed 0, 48 steps; re-derived side by side
by ``benchmarks/scaled_scenarios.py``): simulating them here would take a minute of CPU."""

import pytest

from gyre.sim.runner import compare
from gyre.sim.scenario import Scenario, load_scenario

ORIGINALS = {  # hours (elastic, colocate, async) and speedups, seed 0, 48 steps
    "seed-2.4t": ((75.977, 91.374, 136.084), 1.2027, 1.7911),
    "terminal-bench-like": ((16.238, 24.773, 23.087), 1.5257, 1.4218),
}


def per_slot(sc: Scenario) -> tuple[float, float]:
    """Executions per slot of a step, and GPUs per slot (serving and training capacity behind each)."""
    slots = sc.cluster.cells * sc.cluster.slots_per_cell
    return sc.batch.groups * sc.batch.group_size / slots, sc.cluster.gpus_per_cell / sc.cluster.slots_per_cell


@pytest.mark.parametrize("original", sorted(ORIGINALS))
def test_a_scaled_scenario_keeps_its_originals_ranking_and_speedups(original):
    big, small = load_scenario(original), load_scenario(f"{original}-scaled")
    assert small.cluster.cells >= 8 and small.steps < big.steps
    executions = small.batch.groups * small.batch.group_size
    assert executions < big.batch.groups * big.batch.group_size and small.rollout.median_s <= big.rollout.median_s
    assert per_slot(small) == per_slot(big)  # proportionally smaller cells
    out = compare(small)
    hours = {p["policy"]: p["hours"] for p in out["policies"]}
    (e, c, a), x_colocate, x_async = ORIGINALS[original]
    assert sorted(hours, key=hours.get) == sorted(["elastic", "colocate", "async"], key=dict(zip(
        ["elastic", "colocate", "async"], (e, c, a), strict=True)).get)
    assert out["speedup_vs_colocate"] == pytest.approx(x_colocate, rel=0.05)
    assert out["speedup_vs_async"] == pytest.approx(x_async, rel=0.05)
