"""What happened to each execution, which executions count, and GSPO group advantages.

An execution counts only when an evaluator scored it. A timed-out execution scored on its preserved
workspace (``reward_recorded`` with ``partial``) counts like any other. An evaluator failure is never a
reward of 0: the execution leaves its group and the batch, and the report counts it. When an execution
was evaluated more than once, the latest evaluation event (by ``seq``) decides.
"""

from dataclasses import dataclass
from typing import Literal

import numpy as np

from gyre.events.fields import ExecutionStatus

Verdict = Literal["scored", "eval_error", "harness_error", "pending", "unknown_group"]
"""``pending``: still queued or running, or finished and awaiting its evaluation; its group waits."""


@dataclass(frozen=True)
class ExecutionOutcome:
    """Everything about one execution except its calls: the small side of the log."""

    execution_id: str
    group_id: str | None
    """``None`` when the log has no ``execution_queued`` event for it."""
    task_id: str | None = None
    status: ExecutionStatus | None = None
    """``None`` while not finished."""
    reward: float | None = None
    """Set when the latest evaluation event is a reward."""
    partial: bool = False
    eval_error: str | None = None
    """Set when the latest evaluation event is an ``evaluation_failed``."""
    calls: int = 0
    """Model calls the log holds for it."""

    @property
    def verdict(self) -> Verdict:
        if self.group_id is None:
            return "unknown_group"
        if self.reward is not None:
            return "scored"
        if self.eval_error is not None:
            return "eval_error"
        if self.status == "harness_error":
            return "harness_error"
        return "pending"

    @property
    def timed_out_scored(self) -> bool:
        return self.status == "timed_out" and self.reward is not None


def advantages(rewards: np.ndarray, eps: float) -> np.ndarray:
    """GSPO/GRPO group advantage ``(r - mean) / (std + eps)``, population std over the valid executions."""
    rewards = np.asarray(rewards, dtype=np.float64)
    return (rewards - rewards.mean()) / (rewards.std() + eps)
