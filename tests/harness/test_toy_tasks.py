"""The toy task set: it loads, a right answer earns 1.0, random text earns graded, varying partial credit."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from gyre.events.fields import ExecutionStatus
from gyre.harness import (
    EvaluationContext,
    EvaluationOutcome,
    FailureOutcome,
    PythonEvaluator,
    RewardOutcome,
    Task,
    TaskSet,
    TaskSetError,
)
from gyre.harness.evaluators import load_function
from tests.harness.harness_helpers import TOY_TASKS

TASKS = TaskSet.load(TOY_TASKS)
IN_PROCESS = PythonEvaluator(load_function("grading.py:evaluate", TOY_TASKS.parent), name="toy-grader")
"""The same grading code without a process per call: the agreement test below shows they score alike."""


def right_answer(task: Task) -> str:
    grading: dict[str, Any] = dict(task.spec.grading)
    return {"text": lambda: str(grading["expected"]), "python": lambda: str(grading["reference"]),
            "json": lambda: json.dumps(grading["expected"])}[str(grading["kind"])]()


def score(task: Task, tmp_path: Path, answer: str | None, name: str = "ws",
          status: ExecutionStatus = "completed") -> EvaluationOutcome:
    workspace = tmp_path / name
    workspace.mkdir()
    for rel, text in task.spec.files.items():
        (workspace / rel).write_text(text)
    if answer is not None:
        (workspace / task.spec.answer_file).write_text(answer)
    ctx = EvaluationContext(f"e-{name}", task.spec, workspace, tmp_path / f"{name}-eval", status)
    return task.evaluator.evaluate(ctx)


def test_the_task_set_loads() -> None:
    assert TASKS.name == "toy" and 8 <= len(TASKS) <= 16
    assert {t.spec.grading["kind"] for t in TASKS} == {"text", "python", "json"}
    assert all(t.evaluator.name == "toy-grader" for t in TASKS)
    with pytest.raises(TaskSetError, match="has no task 'nope'; its tasks: hello, "):
        TASKS["nope"]


@pytest.mark.parametrize("task_id", TASKS.ids)
def test_right_answers_earn_full_reward(task_id: str, tmp_path: Path) -> None:
    outcome = score(TASKS[task_id], tmp_path, right_answer(TASKS[task_id]))
    assert isinstance(outcome, RewardOutcome) and outcome.reward == 1.0, outcome


def test_random_text_earns_nonzero_varying_partial_credit(tmp_path: Path) -> None:
    rng = random.Random(7)
    per_task: dict[str, list[float]] = {}
    for task in TASKS:
        fast = Task(task.spec, task.base_dir, IN_PROCESS)
        for i in range(3):
            noise = "".join(chr(rng.randrange(32, 127)) for _ in range(rng.randint(4, 60)))
            outcome = score(fast, tmp_path, noise, name=f"{task.id}-{i}")
            assert isinstance(outcome, RewardOutcome), outcome
            per_task.setdefault(task.id, []).append(outcome.reward)
    rewards = [r for rs in per_task.values() for r in rs]
    assert all(0.0 <= r < 1.0 for r in rewards)
    assert sum(r > 0 for r in rewards) >= 0.8 * len(rewards)  # almost any text shares a character or two
    assert sum(len(set(rs)) > 1 for rs in per_task.values()) >= 0.8 * len(per_task)  # a group has a spread


def test_closer_answers_earn_more(tmp_path: Path) -> None:
    outcomes = [score(TASKS["hello"], tmp_path, text, name=f"h{i}")
                for i, text in enumerate(["zzzzqqqq", "jello there", "hell", "hello"])]
    rewards = [o.reward for o in outcomes if isinstance(o, RewardOutcome)]
    assert rewards == sorted(rewards) and rewards[-1] == 1.0 and rewards[0] < rewards[1]


def test_code_that_does_not_run_gets_partial_credit_not_an_evaluator_crash(tmp_path: Path) -> None:
    add = TASKS["add"]
    for i, source in enumerate(["def add(a, b) return", "raise SystemExit(4)", "import os\nos._exit(0)\n",
                                "def add(a, b):\n    return a - b\n"]):
        outcome = score(add, tmp_path, source, name=f"a{i}")
        assert isinstance(outcome, RewardOutcome), outcome
        assert 0.0 < outcome.reward < 1.0
    assert outcome.details["checks_passed"] == 1  # a - b is right for add(0, 0) only
    fix_mul = score(TASKS["fix-mul"], tmp_path, None, name="untouched")  # the buggy starting file
    assert isinstance(fix_mul, RewardOutcome) and fix_mul.details["checks_passed"] == 1


def test_a_missing_answer_scores_zero_and_partial_runs_are_marked(tmp_path: Path) -> None:
    outcome = score(TASKS["hello"], tmp_path, None, status="timed_out")
    assert isinstance(outcome, RewardOutcome) and outcome.reward == 0.0 and outcome.details["missing"] is True
    assert outcome.partial is True


def test_the_in_process_grader_agrees_with_the_command_evaluator(tmp_path: Path) -> None:
    for task in TASKS:
        via_command = score(task, tmp_path, "hel(lo)", name=f"c-{task.id}")
        in_process = Task(task.spec, task.base_dir, IN_PROCESS)
        direct = score(in_process, tmp_path, "hel(lo)", name=f"p-{task.id}")
        assert isinstance(via_command, RewardOutcome) and isinstance(direct, RewardOutcome)
        assert (via_command.reward, via_command.details) == (direct.reward, direct.details)


def test_a_broken_grading_table_is_an_evaluator_crash(tmp_path: Path) -> None:
    task = TASKS["hello"]
    broken = Task(task.spec.model_copy(update={"grading": {"kind": "vibes"}}), task.base_dir, task.evaluator)
    outcome = score(broken, tmp_path, "hello")
    assert isinstance(outcome, FailureOutcome) and outcome.error == "crash"
    assert "unknown grading kind 'vibes'" in outcome.message


def test_task_set_errors_name_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "tasks.toml"
    path.write_text('name = "x"\n[[tasks]]\nid = "a"\nprompt = "p"\n')
    with pytest.raises(TaskSetError, match="task 'a' has no evaluator"):
        TaskSet.load(path)
    path.write_text('name = "x"\n[evaluator]\ntype = "command"\ncommand = ["x"]\n'
                    '[[tasks]]\nid = "a"\nprompt = "p"\nanswer_file = "../escape.txt"\n')
    with pytest.raises(TaskSetError, match="answer_file must be a relative path inside the workspace"):
        TaskSet.load(path)
    with pytest.raises(TaskSetError, match="cannot read task set"):
        TaskSet.load(tmp_path / "missing.toml")
