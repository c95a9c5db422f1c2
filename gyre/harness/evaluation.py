"""What an evaluator sees and what it returns: a reward with details, or a failure that excludes the execution.

The distinction matters to training: a failure (the evaluator crashed, timed out, or its infrastructure was
missing) says nothing about the policy, so it becomes `evaluation_failed` and the execution is left out of
its group. Turning it into reward 0 would punish the policy for a broken test script.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from gyre.events.fields import EvaluationFailure, ExecutionStatus
from gyre.events.models import EvaluationFailed, RewardRecorded
from gyre.harness.bwrap import SandboxSpec

if TYPE_CHECKING:
    from gyre.harness.tasks import TaskSpec


@dataclass(frozen=True)
class Score:
    """A reward in [0, 1] and JSON-serialisable details, as an evaluator computed them."""

    reward: float
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvaluationContext:
    """Everything an evaluator may use. `scratch_dir` is outside the workspace and belongs to the evaluator."""

    execution_id: str
    task: TaskSpec
    workspace: Path
    scratch_dir: Path
    status: ExecutionStatus = "completed"
    sandbox: SandboxSpec | None = None
    """The sandbox the evaluator runs in, command or Python (the workspace and scratch directory writable, its
    uid and limits); the evaluator adds its task set's directory read-only. None: unsandboxed."""

    @property
    def partial(self) -> bool:
        """True when the harness timed out: the workspace is scored as it was left."""
        return self.status == "timed_out"

    @property
    def answer_path(self) -> Path:
        return self.workspace / self.task.answer_file


@dataclass(frozen=True)
class RewardOutcome:
    evaluator: str
    reward: float
    details: Mapping[str, Any]
    partial: bool
    duration_s: float

    def event(self, execution_id: str) -> RewardRecorded:
        return RewardRecorded(execution_id=execution_id, reward=self.reward, evaluator=self.evaluator,
                              partial=self.partial, details=json.dumps(self.details, sort_keys=True),
                              duration_s=self.duration_s)


@dataclass(frozen=True)
class FailureOutcome:
    evaluator: str
    error: EvaluationFailure
    message: str
    partial: bool
    duration_s: float

    def event(self, execution_id: str) -> EvaluationFailed:
        return EvaluationFailed(execution_id=execution_id, error=self.error, evaluator=self.evaluator,
                                message=self.message)


EvaluationOutcome = RewardOutcome | FailureOutcome


@runtime_checkable
class Evaluator(Protocol):
    """Scores a workspace. Never raises for a failure of the evaluation itself: returns a `FailureOutcome`."""

    name: str

    def evaluate(self, context: EvaluationContext) -> EvaluationOutcome: ...


def checked_outcome(evaluator: str, reward: object, details: object, *, partial: bool,
                    duration_s: float) -> EvaluationOutcome:
    """A `RewardOutcome` when `reward` is a finite number in [0, 1] and `details` a JSON object, else a crash.

    An out-of-range reward is a bug in the evaluator, not a score: clamping it would hide the bug.
    """

    def crash(message: str) -> FailureOutcome:
        return FailureOutcome(evaluator, "crash", message, partial, duration_s)

    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return crash(f"reward must be a number, got {type(reward).__name__} {reward!r}")
    if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        return crash(f"reward {reward!r} is outside [0, 1]")
    if not isinstance(details, Mapping):
        return crash(f"details must be a JSON object, got {type(details).__name__}")
    try:
        plain = json.loads(json.dumps(details, allow_nan=False))
    except (TypeError, ValueError) as e:
        return crash(f"details are not JSON-serialisable: {e}")
    return RewardOutcome(evaluator, float(reward), plain, partial, duration_s)
