"""`gyre.harness`: runs unmodified harnesses as subprocesses in their own workspaces, then scores them.

    taskset = TaskSet.load("tasks/toy/tasks.toml")   # sink: any gyre.sink.EventSink
    config = HarnessConfig.load("agents/toy_agent/harness.toml")
    with HarnessRunner(config, sink=sink, proxy_url=proxy_url, root=run_dir / "executions") as runner:
        results = runner.run_group([Execution(f"g0-{i}", taskset["hello"], "g0", token=tokens[i])
                                    for i in range(16)])
    rewards = [r.reward for r in results]   # None: excluded (evaluation failed or not evaluated)

See docs/harness.md.
"""

from gyre.harness.config import (
    EVALUATOR_PLACEHOLDERS,
    HARNESS_PLACEHOLDERS,
    CommandEvaluatorConfig,
    EvaluatorConfig,
    HarnessConfig,
    PythonEvaluatorConfig,
)
from gyre.harness.errors import HarnessError, TaskSetError, TemplateError, WorkspaceError
from gyre.harness.evaluation import (
    EvaluationContext,
    EvaluationOutcome,
    Evaluator,
    FailureOutcome,
    RewardOutcome,
    Score,
)
from gyre.harness.evaluators import CommandEvaluator, PythonEvaluator, build_evaluator
from gyre.harness.runner import Execution, ExecutionResult, HarnessRunner
from gyre.harness.tasks import Task, TaskSet, TaskSetSpec, TaskSpec
from gyre.harness.workspace import ExecutionDirs

__all__ = [
    "EVALUATOR_PLACEHOLDERS",
    "HARNESS_PLACEHOLDERS",
    "CommandEvaluator",
    "CommandEvaluatorConfig",
    "EvaluationContext",
    "EvaluationOutcome",
    "Evaluator",
    "EvaluatorConfig",
    "Execution",
    "ExecutionDirs",
    "ExecutionResult",
    "FailureOutcome",
    "HarnessConfig",
    "HarnessError",
    "HarnessRunner",
    "PythonEvaluator",
    "PythonEvaluatorConfig",
    "RewardOutcome",
    "Score",
    "Task",
    "TaskSet",
    "TaskSetError",
    "TaskSetSpec",
    "TaskSpec",
    "TemplateError",
    "WorkspaceError",
    "build_evaluator",
]
