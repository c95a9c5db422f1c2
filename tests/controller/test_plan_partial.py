"""The run plan with partial rollouts: over-sampled queueing, steps taking the groups the fold assigns them
(carried groups, due ones first), as `gyre sim` models them — pure functions of a fold of events."""

import json

import pytest

from gyre.controller.plan import (
    RunPlan,
    batch_parts,
    next_step_to_queue,
    next_step_to_train,
    step_groups,
)
from gyre.events.models import (
    CellRegistered,
    ExecutionQueued,
    RewardRecorded,
    RunStarted,
    TrainStepFinished,
    TrainStepStarted,
    WeightsPublished,
)
from gyre.scheduler import SchedulerFold

PLAN = RunPlan(steps=3, partial=True, oversample=1, batch_executions=2, groups=2)
"""Two groups of one execution per step, one group of the next batch over-sampled with each."""


def fold() -> SchedulerFold:
    f = SchedulerFold()
    params = json.dumps({"partial_rollouts": True, "oversample_groups": 1})
    for event in (RunStarted(run_id="r", name="t", policy="async", policy_version="1", policy_params=params),
                  CellRegistered(cell_id="c0", role="training", slots=2, is_core=True),
                  CellRegistered(cell_id="c1", role="rollout", slots=2)):
        f.apply(event)
    return f


def queue(f: SchedulerFold, step: int, version: int) -> None:
    for batch, groups in batch_parts(PLAN, step):
        for g in groups:
            f.apply(ExecutionQueued(execution_id=f"s{batch}g{g}", task_id="t", group_id=f"s{batch}g{g}",
                                    step=batch, policy_version=version))


def score(f: SchedulerFold, group: str) -> None:
    f.apply(RewardRecorded(execution_id=group, reward=1.0))


def train(f: SchedulerFold, step: int) -> None:
    f.apply(TrainStepStarted(step=step, policy_version=step, planned_micro_steps=2, groups=2))
    f.apply(TrainStepFinished(step=step, policy_version=step + 1, micro_steps=2))
    f.apply(WeightsPublished(policy_version=step + 1))


def test_each_batch_is_queued_with_the_first_groups_of_the_next_and_without_those_queued_before():
    assert batch_parts(PLAN, 0) == [(0, range(0, 2)), (1, range(0, 1))]
    assert batch_parts(PLAN, 1) == [(1, range(1, 2)), (2, range(0, 1))]
    assert batch_parts(PLAN, 2) == [(2, range(1, 2))]
    assert batch_parts(RunPlan(steps=3, groups=2), 1) == [(1, range(2))]


def test_a_step_takes_the_first_complete_groups_and_a_carried_group_is_due_at_the_next():
    f = fold()
    view = f.view
    assert next_step_to_queue(view, PLAN) == 0
    queue(f, 0, 0)
    assert next_step_to_queue(view, PLAN) is None  # batch 1 is only partly queued: it waits for step 0's weights
    score(f, "s1g0")  # the over-sampled group completes first
    assert next_step_to_train(view, plan=PLAN) is None  # one group of two
    score(f, "s0g0")
    assert next_step_to_train(view, plan=PLAN) == 0
    assert step_groups(view, 0, PLAN) == ("s1g0", "s0g0")  # s0g1 still runs: carried
    train(f, 0)
    assert view.work.assigned[0] == ["s1g0", "s0g0"]
    assert next_step_to_queue(view, PLAN) == 1
    queue(f, 1, 1)
    score(f, "s1g1")
    score(f, "s2g0")  # complete, but a slot is kept for the due carried group
    assert next_step_to_train(view, plan=PLAN) is None
    score(f, "s0g1")
    assert next_step_to_train(view, plan=PLAN) == 1
    assert step_groups(view, 1, PLAN) == ("s1g1", "s0g1")
    train(f, 1)
    assert step_groups(view, 1) == ("s1g1", "s0g1")  # retrained after a crash: the groups the fold assigned


def test_over_sampling_is_refused_without_partial_rollouts_or_over_half_a_batch():
    with pytest.raises(ValueError, match="partial_rollouts"):
        RunPlan(steps=2, oversample=1, batch_executions=2, groups=2)
    with pytest.raises(ValueError, match="half a batch"):
        RunPlan(steps=2, partial=True, oversample=2, batch_executions=3, groups=3)
