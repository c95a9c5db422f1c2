"""Held-out evaluation: which tasks are held out, when it runs, and how its pass rate is counted."""

from pathlib import Path

import pytest

from gyre.errors import ConfigError
from gyre.evaluation import HeldOutPlan, heldout_executions, plan_heldout, summarize
from gyre.harness.tasks import TaskSet

TOY = TaskSet.load(Path("tasks/toy/tasks.toml"))
ALL = [t.id for t in TOY]


def test_by_default_every_task_training_leaves_out_is_held_out() -> None:
    plan = plan_heldout(2, TOY, (), ["hello", "shout"], samples=1, pass_threshold=1.0)
    assert set(plan.task_ids) == set(ALL) - {"hello", "shout"} and plan.task_ids


@pytest.mark.parametrize(("task_ids", "trained", "message"), [
    (("hello",), ("hello", "shout"), r"\['hello'\] are also trained on"),
    (("nope",), ("hello",), r"unknown task\(s\) \['nope'\]"),
    ((), tuple(ALL), "no task is held out"),
])
def test_bad_plans_are_named(task_ids: tuple[str, ...], trained: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_heldout(1, TOY, task_ids, trained, samples=1, pass_threshold=1.0)


def test_off_by_default_and_due_every_n_steps_and_at_the_end() -> None:
    assert not plan_heldout(0, TOY, (), tuple(ALL), samples=1, pass_threshold=1.0).due(0, 4)
    plan = HeldOutPlan(every=2, task_ids=("sum",), samples=1, pass_threshold=1.0)
    assert [s for s in range(6) if plan.due(s, 5)] == [0, 2, 4, 5]


def test_pass_rate_counts_scored_executions_and_excludes_evaluator_failures() -> None:
    plan = HeldOutPlan(every=1, task_ids=("sum", "hello-world"), samples=2, pass_threshold=0.9)
    event = summarize([1.0, 0.95, 0.2, None, None], plan, step=3, policy_version=3, duration_s=2.0)
    assert (event.executions, event.scored, event.passed) == (5, 3, 2)
    assert event.pass_rate == pytest.approx(2 / 3) and event.reward_mean == pytest.approx((1.0 + 0.95 + 0.2) / 3)
    assert event.group_prefix == "heldout-s3-" and event.tasks == 2
    nothing = summarize([None], plan, step=0, policy_version=0, duration_s=0.0)
    assert nothing.pass_rate is None and nothing.reward_mean is None


def test_an_evaluation_samples_every_held_out_task_in_groups_no_step_trains() -> None:
    plan = HeldOutPlan(every=1, task_ids=("sum", "reverse-word"), samples=2, pass_threshold=1.0)
    executions = heldout_executions(plan, 2)
    assert [e for e, _, _ in executions] == ["heldout-s2-sum-e0", "heldout-s2-sum-e1",
                                                    "heldout-s2-reverse-word-e0", "heldout-s2-reverse-word-e1"]
    assert [t for _, _, t in executions] == ["sum", "sum", "reverse-word", "reverse-word"]
    assert {g for _, g, _ in executions} == {"heldout-s2-sum", "heldout-s2-reverse-word"}
