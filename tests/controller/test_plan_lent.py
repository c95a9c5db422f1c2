"""A step's start while a lent cell is still on its way to training: held (the default, so that the cell joins
from the first micro-step where a toy step is shorter than a switch), or not (``wait_for_lent`` off, as `gyre
sim` models it and `--emulate` runs: the cell claims what is left of the open step when it arrives)."""

import json

import pytest

from gyre.controller.plan import RunPlan, next_step_to_train
from gyre.events.models import (
    CellRegistered,
    ExecutionQueued,
    RewardRecorded,
    RoleSwitchCompleted,
    RoleSwitchRequested,
    RunStarted,
)
from gyre.scheduler import SchedulerFold


def lending() -> SchedulerFold:
    """A core in training, one cell lent to training from rollout (not there yet), a group of step 0 scored."""
    f = SchedulerFold()
    for event in (RunStarted(run_id="r", name="t", policy="elastic", policy_version="2",
                             policy_params=json.dumps({"stream_micro_steps": True})),
                  CellRegistered(cell_id="c0", role="training", slots=2, is_core=True),
                  CellRegistered(cell_id="c1", role="rollout", slots=2),
                  ExecutionQueued(execution_id="e0", task_id="t", group_id="g0", step=0, policy_version=0),
                  ExecutionQueued(execution_id="e1", task_id="t", group_id="g1", step=0, policy_version=0),
                  RewardRecorded(execution_id="e0", reward=1.0),
                  RoleSwitchRequested(cell_id="c1", from_role="rollout", to_role="training")):
        f.apply(event)
    return f


@pytest.mark.parametrize("wait", [True, False])
def test_a_step_waits_for_a_lent_cell_only_where_the_plan_says(wait: bool) -> None:
    f = lending()
    plan = RunPlan(steps=2, stream=True, wait_for_lent=wait)
    assert [c.cell_id for c in f.view.entering("training")] == ["c1"]
    assert next_step_to_train(f.view, plan.stream, plan) == (None if wait else 0)
    f.apply(RoleSwitchCompleted(cell_id="c1", from_role="rollout", to_role="training", duration_s=1.0))
    assert next_step_to_train(f.view, plan.stream, plan) == 0  # arrived: nothing holds the step
