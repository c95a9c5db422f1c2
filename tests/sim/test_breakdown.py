"""The cell-time breakdown: read-only, complete, and it tells the designs apart where they differ."""

import json

import pytest
import typer
from typer.testing import CliRunner

from gyre.scheduler import get_policy
from gyre.sim.breakdown import CATEGORIES
from gyre.sim.cli import sim_app
from gyre.sim.runner import policy_params, simulate
from gyre.sim.scenario import load_scenario

app = typer.Typer()
app.add_typer(sim_app, name="sim")
runner = CliRunner()
V3 = {"partial_rollouts": True, "oversample_groups": 2, "spread_tail": True, "backlog_loans": True,
      "idle_recall": True}


@pytest.mark.parametrize("policy, version, overrides", [
    ("elastic", None, {}), ("elastic", "elastic/3", V3), ("colocate", None, {}), ("async", None, {})])
def test_observing_changes_nothing_and_every_cell_second_is_counted(policy, version, overrides):
    sc = load_scenario("tiny")
    params = policy_params(sc, get_policy(policy, version), overrides)
    plain = simulate(sc, policy, steps=3, params=params, version=version)
    seen = simulate(sc, policy, steps=3, params=params, version=version, cell_time=True)
    assert plain.cell_time is None and seen.cell_time is not None
    assert seen.to_dict() | {"cell_time": None} == plain.to_dict()  # the run is the run without it
    shares = seen.cell_time
    assert list(shares) == list(CATEGORIES) and min(shares.values()) >= 0
    assert sum(shares.values()) == pytest.approx(1, abs=1e-3)
    # slots held and training busy are exactly what the run's utilization counts
    assert shares["rollout_held"] + shares["training_busy"] == pytest.approx(seen.utilization, abs=2e-4)


def test_fixed_pools_never_switch_and_split_the_cells_as_configured():
    """async's pools are fixed from registration: no cell-time switching or pulling weights, and the
    rollout side's share is exactly its cells' share (here 2 of tiny's 3 cells)."""
    sc = load_scenario("tiny")
    params = policy_params(sc, get_policy("async"), {"training_cells": 1})
    shares = simulate(sc, "async", steps=3, params=params, cell_time=True).cell_time
    assert shares is not None and shares["switching"] == shares["joining"] == 0
    rollout = shares["rollout_held"] + shares["rollout_free_queued"] + shares["rollout_free_idle"]
    assert rollout == pytest.approx((sc.cluster.cells - 1) / sc.cluster.cells, abs=1e-3)


def test_colocate_waits_with_the_whole_cluster():
    """colocate trains only once the batch is complete: its training cells never wait on rollouts with
    a step half-claimed while executions are queued, and its rollout cells sit free at every batch's tail."""
    shares = simulate(load_scenario("tiny"), "colocate", steps=3, cell_time=True).cell_time
    assert shares is not None and shares["training_waiting_queued"] == 0 and shares["rollout_free_idle"] > 0


def test_cli_reports_it_for_one_run_only():
    result = runner.invoke(app, ["sim", "tiny", "--steps", "2", "--json", "--cell-time"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.stdout)["cell_time"]) == set(CATEGORIES)
    refused = runner.invoke(app, ["sim", "tiny", "--ablate", "--cell-time"])
    assert refused.exit_code == 2 and "--cell-time" in refused.output
