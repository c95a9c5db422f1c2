"""Colocate and async on hand-built views, plus parameter validation."""

import pytest

from gyre.errors import ConfigError
from gyre.events.models import CellLost
from gyre.scheduler import ASYNC, COLOCATE, ELASTIC, AsyncParams, ColocateParams, get_policy
from gyre.scheduler.policy import CellSpec

ALL = ["cell-0", "cell-1", "cell-2", "cell-3"]


def test_colocate_rolls_out_until_the_batch_is_done(cluster):
    executions = cluster.run(3, ALL)
    for execution in executions[:2]:
        cluster.finish(execution)
    assert COLOCATE.decide(cluster.view, ColocateParams()) == []  # one execution still running
    cluster.finish(executions[2])
    decisions = COLOCATE.decide(cluster.view, ColocateParams())
    assert [(d.cell_id, d.to_role) for d in decisions] == [(c, "training") for c in ALL]


def test_colocate_returns_everyone_once_the_step_is_trained(cluster):
    for execution in cluster.run(2, ALL):
        cluster.finish(execution)
    cluster.apply(COLOCATE.decide(cluster.view, ColocateParams()))
    cluster.open_step(0)
    cluster.queue(4, step=1)
    assert COLOCATE.decide(cluster.view, ColocateParams()) == []  # the step is still open
    cluster.close_step(0)
    assert [(d.cell_id, d.to_role) for d in COLOCATE.decide(cluster.view, ColocateParams())] == [
        (c, "rollout") for c in ALL]


def test_colocate_is_on_policy_by_construction():
    with pytest.raises(ConfigError, match="staleness"):
        COLOCATE.params({"staleness": 1})


def test_async_pools_are_fixed_at_registration(make_cluster):
    cells = [CellSpec(f"cell-{i}", i == 0, 8) for i in range(4)]
    roles = ASYNC.initial_roles(cells, AsyncParams(training_cells=2))
    assert roles == {"cell-0": "training", "cell-1": "training", "cell-2": "rollout", "cell-3": "rollout"}
    cluster = make_cluster(roles=roles)
    cluster.run(40, ["cell-2", "cell-3"])
    assert ASYNC.decide(cluster.view, AsyncParams(training_cells=2)) == []  # never lends, whatever the load


def test_async_reforms_its_pool_when_a_training_cell_is_lost(make_cluster):
    cluster = make_cluster(roles={"cell-0": "training", "cell-1": "training"})
    cluster.fold.apply(CellLost(cell_id="cell-1"))
    [decision] = ASYNC.decide(cluster.view, AsyncParams(training_cells=2))
    assert (decision.cell_id, decision.to_role) == ("cell-2", "training")


def test_unknown_policy_and_bad_parameters_are_named():
    with pytest.raises(ConfigError, match="unknown policy 'greedy'; known policies: elastic, colocate, async"):
        get_policy("greedy")
    with pytest.raises(ConfigError, match="hysteresis_slots"):
        ELASTIC.params({"hysteresis_slots": -1})
    with pytest.raises(ConfigError, match="speed"):
        ELASTIC.params({"speed": 2})
    assert ELASTIC.params('{"staleness": 1}').staleness == 1


def test_partial_rollouts_fill_a_step_with_due_groups_first_and_keep_room_for_running_ones():
    """Step 2 at staleness 0: groups first queued at version 1 or earlier are due (one more step would make
    them 2 versions old); complete others of batches <= 3 fill the rest in completion order, but never
    the room a due group that is still running needs; batch 4 is not eligible yet."""
    from gyre.scheduler.view import WorkState

    work = WorkState(partial_rollouts=True, staleness=0)
    work.group_origin = {"old-running": (1, 1), "old-done": (1, 1), "a": (2, 2), "b": (3, 2), "c": (2, 2),
                         "far": (4, 2)}
    work.pool = ["far", "a", "old-done", "b", "c"]
    take, full = work.assignable(2, groups=3)
    assert take == ["a", "old-done"] and not full  # "b" would take the room "old-running" needs
    work.pool.append("old-running")
    take, full = work.assignable(2, groups=3)
    assert take == ["a", "old-done", "old-running"] and full
