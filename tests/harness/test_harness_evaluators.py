"""Evaluators: rewards with details, partial scoring after a timeout, and every failure as a failure."""

from __future__ import annotations

import functools
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gyre.errors import ConfigError
from gyre.events.fields import ExecutionStatus
from gyre.harness import (
    EVALUATOR_PLACEHOLDERS,
    CommandEvaluator,
    CommandEvaluatorConfig,
    EvaluationContext,
    FailureOutcome,
    PythonEvaluator,
    PythonEvaluatorConfig,
    RewardOutcome,
    Score,
    TaskSpec,
    build_evaluator,
)
from gyre.harness.evaluators import load_function
from tests.harness.harness_helpers import (
    allocates_forever,
    constant,
    divides_by_zero,
    exits,
    exits_hard,
    loops_forever,
    process_gone,
    read_answer,
    spawns_an_escaping_child,
    wait_for,
)

SCRIPT_HEADER = "import json, sys, pathlib\n"


def context(tmp_path: Path, status: ExecutionStatus = "completed", answer: str | None = "hello") -> EvaluationContext:
    workspace = tmp_path / "workspace"
    workspace.mkdir(exist_ok=True)
    if answer is not None:
        (workspace / "answer.txt").write_text(answer)
    spec = TaskSpec(id="t", prompt="p", grading={"expected": "hello"})
    return EvaluationContext("e1", spec, workspace, tmp_path / "evaluation", status)


def command(tmp_path: Path, body: str, **config: Any) -> CommandEvaluator:
    script = tmp_path / "judge.py"
    script.write_text(SCRIPT_HEADER + body)
    settings = {"type": "command", "name": "judge", "command": ["{python}", str(script), "{grading_file}"]} | config
    return CommandEvaluator(CommandEvaluatorConfig(**settings), tmp_path)


GRADE = """
doc = json.loads(pathlib.Path(sys.argv[1]).read_text())
answer = pathlib.Path(doc["answer_file"]).read_text()
print("some noise first")
print(json.dumps({"reward": 1.0 if answer == doc["grading"]["expected"] else 0.25,
                  "details": {"answer": answer, "partial": doc["partial"], "status": doc["status"]}}))
"""


def test_command_evaluator_reward_with_details(tmp_path: Path) -> None:
    outcome = command(tmp_path, GRADE).evaluate(context(tmp_path))
    assert isinstance(outcome, RewardOutcome)
    assert outcome.reward == 1.0 and outcome.evaluator == "judge" and outcome.partial is False
    assert outcome.details == {"answer": "hello", "partial": False, "status": "completed"}
    event = outcome.event("e1")
    assert event.kind == "reward_recorded" and event.reward == 1.0 and '"answer": "hello"' in event.details


def test_partial_evaluation_after_a_timeout(tmp_path: Path) -> None:
    outcome = command(tmp_path, GRADE).evaluate(context(tmp_path, "timed_out", answer="hel"))
    assert isinstance(outcome, RewardOutcome)
    assert outcome.partial is True and outcome.reward == 0.25 and outcome.details["partial"] is True
    assert outcome.event("e1").partial is True


@pytest.mark.parametrize(("body", "needle"), [
    ("raise RuntimeError('judge exploded')\n", "judge exploded"),
    ("print('not json')\n", "not JSON"),
    ("print('[1, 2]')\n", "not a JSON object"),
    ("pass\n", "printed nothing"),
    ("print(json.dumps({'reward': 1.5}))\n", "outside [0, 1]"),
    ("print(json.dumps({'reward': 'high'}))\n", "must be a number"),
    ("print(json.dumps({'details': {}}))\n", "must be a number"),
    ("print(json.dumps({'reward': 0.5, 'details': [1]}))\n", "details must be a JSON object"),
    ("print(json.dumps({'error': 'weird'}))\n", "unknown error kind"),
])
def test_command_evaluator_crashes_are_failures_not_zero_rewards(tmp_path: Path, body: str, needle: str) -> None:
    outcome = command(tmp_path, body).evaluate(context(tmp_path))
    assert isinstance(outcome, FailureOutcome), outcome
    assert outcome.error == "crash" and needle in outcome.message
    event = outcome.event("e1")
    assert event.kind == "evaluation_failed" and event.error == "crash" and event.evaluator == "judge"


def test_command_evaluator_timeout_kills_it(tmp_path: Path) -> None:
    evaluator = command(tmp_path, "import time\nprint('started', file=sys.stderr, flush=True)\ntime.sleep(300)\n",
                        timeout_s=0.5, kill_grace_s=0.1)
    began = time.monotonic()
    outcome = evaluator.evaluate(context(tmp_path))
    assert time.monotonic() - began < 5
    assert isinstance(outcome, FailureOutcome) and outcome.error == "timeout"
    assert "timed out after 0.5s" in outcome.message and "started" in outcome.message


def test_infrastructure_failures(tmp_path: Path) -> None:
    missing_program = CommandEvaluator(CommandEvaluatorConfig(type="command", command=["/nonexistent/judge"]),
                                       tmp_path)
    outcome = missing_program.evaluate(context(tmp_path))
    assert isinstance(outcome, FailureOutcome) and outcome.error == "infrastructure"
    assert "cannot start evaluator command" in outcome.message
    reported = command(tmp_path, "print(json.dumps({'error': 'infrastructure', 'message': 'no docker'}))\n")
    outcome = reported.evaluate(context(tmp_path))
    assert isinstance(outcome, FailureOutcome) and (outcome.error, outcome.message) == ("infrastructure", "no docker")
    gone = context(tmp_path)
    gone = EvaluationContext(gone.execution_id, gone.task, tmp_path / "deleted", gone.scratch_dir)
    for evaluator in (command(tmp_path, GRADE), PythonEvaluator(read_answer)):
        outcome = evaluator.evaluate(gone)
        assert isinstance(outcome, FailureOutcome) and outcome.error == "infrastructure"


def test_command_evaluator_runs_in_the_workspace_with_its_placeholders(tmp_path: Path) -> None:
    body = "print(json.dumps({'reward': 0.5, 'details': {'argv': sys.argv[1:], 'cwd': str(pathlib.Path.cwd())}}))\n"
    evaluator = command(tmp_path, body, command=["{python}", str(tmp_path / "judge.py"), "{task_id}", "{status}",
                                                 "{partial}", "{answer_file}", "{taskset_dir}"])
    (tmp_path / "judge.py").write_text(SCRIPT_HEADER + body)
    outcome = evaluator.evaluate(context(tmp_path, "timed_out"))
    assert isinstance(outcome, RewardOutcome)
    assert outcome.details["argv"] == ["t", "timed_out", "1", "answer.txt", str(tmp_path)]
    every = command(tmp_path, body, command=["{python}", str(tmp_path / "judge.py"),
                                             *[f"{{{n}}}" for n in sorted(EVALUATOR_PLACEHOLDERS)]])
    outcome = every.evaluate(context(tmp_path))
    assert isinstance(outcome, RewardOutcome) and len(outcome.details["argv"]) == len(EVALUATOR_PLACEHOLDERS)
    assert outcome.details["cwd"] == str(tmp_path / "workspace")
    with pytest.raises(ValueError, match=r"unknown placeholder \{prompt\}"):
        CommandEvaluatorConfig(type="command", command=["judge", "{prompt}"])


def test_python_evaluator_results(tmp_path: Path) -> None:
    ctx = context(tmp_path)
    for result, reward, details in [(0.75, 0.75, {}), ((1, {"k": 1}), 1.0, {"k": 1}),
                                    (Score(0.5, {"why": "half"}), 0.5, {"why": "half"})]:
        outcome = PythonEvaluator(functools.partial(constant, result), name="py").evaluate(ctx)
        assert isinstance(outcome, RewardOutcome) and (outcome.reward, outcome.details) == (reward, details)


@pytest.mark.parametrize(("result", "needle"), [
    (math.nan, "outside [0, 1]"), (-0.1, "outside [0, 1]"), (True, "must be a number"), ("1", "must be a number"),
    ((0.5, {"bad": object()}), "not JSON-serialisable"), ((0.5, {"x": math.inf}), "not JSON-serialisable"),
])
def test_python_evaluator_invalid_results_are_crashes(tmp_path: Path, result: object, needle: str) -> None:
    outcome = PythonEvaluator(functools.partial(constant, result)).evaluate(context(tmp_path))
    assert isinstance(outcome, FailureOutcome) and outcome.error == "crash" and needle in outcome.message


def test_python_evaluator_crash_and_timeout(tmp_path: Path) -> None:
    outcome = PythonEvaluator(divides_by_zero, name="py").evaluate(context(tmp_path))
    assert isinstance(outcome, FailureOutcome) and outcome.error == "crash"
    assert outcome.message.startswith("ZeroDivisionError: division by zero at ")
    outcome = PythonEvaluator(exits).evaluate(context(tmp_path))
    assert isinstance(outcome, FailureOutcome) and outcome.error == "crash" and "SystemExit: 3" in outcome.message
    outcome = PythonEvaluator(loops_forever, timeout_s=0.5).evaluate(context(tmp_path, "timed_out"))
    assert isinstance(outcome, FailureOutcome) and outcome.error == "timeout" and outcome.partial is True
    assert "did not return within 0.5s" in outcome.message


def test_python_evaluator_runs_in_a_child_that_can_die(tmp_path: Path) -> None:
    """Out of memory, a hard exit, a signal: each is a crash of the child, and this process carries on."""
    outcome = PythonEvaluator(allocates_forever, memory_mb=512).evaluate(context(tmp_path))
    assert isinstance(outcome, FailureOutcome) and outcome.error == "crash"
    assert "out of memory (limit 512 MiB)" in outcome.message
    outcome = PythonEvaluator(exits_hard, name="quitter").evaluate(context(tmp_path))
    assert isinstance(outcome, FailureOutcome) and outcome.error == "crash"
    assert "'quitter' exited with code 7 without a result" in outcome.message
    outcome = PythonEvaluator(read_answer).evaluate(context(tmp_path))  # the warm parent still serves
    assert isinstance(outcome, RewardOutcome) and outcome.reward == 1.0


def test_python_evaluator_leaves_no_process_behind(tmp_path: Path) -> None:
    """A grandchild that left the evaluator's session (double fork + setsid) is killed when it returns."""
    ctx = context(tmp_path)
    outcome = PythonEvaluator(spawns_an_escaping_child).evaluate(ctx)
    assert isinstance(outcome, RewardOutcome) and outcome.reward == 1.0
    pid = int((ctx.scratch_dir / "escaped.pid").read_text())
    wait_for(lambda: process_gone(pid), what=f"the escaped grandchild {pid} to be killed")


def test_python_evaluator_must_pickle(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="module-level function"):
        PythonEvaluator(lambda _c: 1.0)


def test_command_evaluator_memory_limit(tmp_path: Path) -> None:
    hog = "hoard = []\nwhile True:\n    hoard.append(bytearray(64 << 20))\n"
    outcome = command(tmp_path, hog, memory_mb=512).evaluate(context(tmp_path))
    assert isinstance(outcome, FailureOutcome) and outcome.error == "crash" and "MemoryError" in outcome.message


def test_python_evaluator_loading(tmp_path: Path) -> None:
    (tmp_path / "judge.py").write_text("def grade(context):\n    return 0.25\n")
    evaluator = build_evaluator(PythonEvaluatorConfig(type="python", name="j", function="judge.py:grade"), tmp_path)
    outcome = evaluator.evaluate(context(tmp_path))
    assert isinstance(outcome, RewardOutcome) and outcome.reward == 0.25 and outcome.evaluator == "j"
    assert load_function("tests.harness.harness_helpers:read_answer", tmp_path) is read_answer
    with pytest.raises(ConfigError, match="has no callable 'nope'"):
        load_function("judge.py:nope", tmp_path)
    with pytest.raises(ConfigError, match=r"cannot load 'missing\.py'"):
        load_function("missing.py:grade", tmp_path)
    with pytest.raises(ConfigError, match="cannot load 'no_such_module_xyz'"):
        load_function("no_such_module_xyz:grade", tmp_path)


def test_a_child_that_cannot_be_prepared_is_an_infrastructure_failure(tmp_path: Path) -> None:
    """Code piped to `python -` has a `__main__` that multiprocessing cannot import in the child."""
    script = (f"from pathlib import Path\nfrom gyre.harness import EvaluationContext, PythonEvaluator, TaskSpec\n"
              f"from tests.harness.harness_helpers import read_answer\n"
              f"w = Path({str(tmp_path)!r}) / 'w'\nw.mkdir()\n"
              f"ctx = EvaluationContext('e', TaskSpec(id='t', prompt='p'), w, w.parent / 's')\n"
              f"print(PythonEvaluator(read_answer).evaluate(ctx).error)\n")
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.stdout.strip() == "infrastructure", done.stderr[-2000:]
