"""Held-out evaluation: which tasks are held out, when it runs, and how its pass rate is counted."""

from concurrent.futures import Future
from pathlib import Path

import pytest

from gyre.errors import ConfigError
from gyre.evaluation import HeldOutEvaluator, HeldOutPlan, plan_heldout, summarize
from gyre.harness.evaluation import FailureOutcome, RewardOutcome
from gyre.harness.runner import Execution, ExecutionResult
from gyre.harness.tasks import TaskSet
from gyre.harness.workspace import ExecutionDirs

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


def _result(execution_id: str, outcome: RewardOutcome | FailureOutcome | None) -> ExecutionResult:
    return ExecutionResult(execution_id, "sum", "g", "completed", 0, 1.0, "", ExecutionDirs(Path("/nowhere")),
                           outcome)


def _reward(value: float) -> RewardOutcome:
    return RewardOutcome(evaluator="toy", reward=value, details={}, partial=False, duration_s=0.0)


def test_pass_rate_counts_scored_executions_and_excludes_evaluator_failures() -> None:
    plan = HeldOutPlan(every=1, task_ids=("sum", "hello-world"), samples=2, pass_threshold=0.9)
    failure = FailureOutcome(evaluator="toy", error="evaluator_crashed", message="boom", partial=False,
                             duration_s=0.0)
    results = [_result("a", _reward(1.0)), _result("b", _reward(0.95)), _result("c", _reward(0.2)),
               _result("d", failure), _result("e", None)]
    event = summarize(results, plan, step=3, policy_version=3, duration_s=2.0)
    assert (event.executions, event.scored, event.passed) == (5, 3, 2)
    assert event.pass_rate == pytest.approx(2 / 3) and event.reward_mean == pytest.approx((1.0 + 0.95 + 0.2) / 3)
    assert event.group_prefix == "heldout-s3-" and event.tasks == 2
    nothing = summarize([_result("d", failure)], plan, step=0, policy_version=0, duration_s=0.0)
    assert nothing.pass_rate is None and nothing.reward_mean is None


def test_the_evaluator_registers_runs_and_records_then_unregisters() -> None:
    plan = HeldOutPlan(every=1, task_ids=("sum", "reverse-word"), samples=2, pass_threshold=1.0)
    registered, unregistered, recorded, submitted = [], [], [], []

    def submit(execution: Execution) -> Future[ExecutionResult]:
        submitted.append(execution)
        future: Future[ExecutionResult] = Future()
        future.set_result(_result(execution.execution_id, _reward(1.0 if execution.task.id == "sum" else 0.0)))
        return future

    evaluator = HeldOutEvaluator(plan, TOY, submit=submit, register=lambda e, v: registered.append((e, v)) or "tok",
                                 unregister=unregistered.append, record=recorded.append, cell_id="cell0")
    event = evaluator.maybe_run(2, 10, policy_version=7)
    assert event is not None and recorded == [event]
    assert event.pass_rate == 0.5 and event.policy_version == 7 and event.step == 2
    ids = [e.execution_id for e in submitted]
    assert ids == ["heldout-s2-sum-e0", "heldout-s2-sum-e1", "heldout-s2-reverse-word-e0",
                   "heldout-s2-reverse-word-e1"]
    assert all(e.group_id.startswith(event.group_prefix) and e.policy_version == 7 for e in submitted)
    assert registered == [(i, 7) for i in ids] and unregistered == ids
