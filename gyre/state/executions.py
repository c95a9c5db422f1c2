"""The executions view: each execution's status, timings, calls, tokens, reward or evaluation failure."""

from dataclasses import dataclass, field

from gyre.state.fold import Projection, on


@dataclass
class Execution:
    execution_id: str
    task_id: str = ""
    group_id: str = ""
    status: str = "queued"
    """queued | running | completed | timed_out | harness_error"""
    cell_id: str | None = None
    policy_version: int = 0
    queued_us: int | None = None
    started_us: int | None = None
    finished_us: int | None = None
    duration_s: float | None = None
    calls: int = 0
    output_tokens: int = 0
    reward: float | None = None
    reward_partial: bool = False
    evaluation_error: str | None = None

    @property
    def scored(self) -> bool:
        """Has a usable reward; an evaluator failure is never a reward (of 0 or otherwise)."""
        return self.reward is not None and self.evaluation_error is None


@dataclass
class ExecutionsState:
    executions: dict[str, Execution] = field(default_factory=dict)

    def get(self, execution_id: str) -> Execution:
        execution = self.executions.get(execution_id)
        if execution is None:
            execution = self.executions[execution_id] = Execution(execution_id)
        return execution

    def by_status(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for execution in self.executions.values():
            counts[execution.status] = counts.get(execution.status, 0) + 1
        return counts

    def group(self, group_id: str) -> list[Execution]:
        return [e for e in self.executions.values() if e.group_id == group_id]


class ExecutionsView(Projection[ExecutionsState]):
    name = "executions"
    state_type = ExecutionsState

    @on("execution_queued", "execution_id", "task_id", "group_id", "policy_version", "ts")
    def _queued(self, s: ExecutionsState, execution_id, task_id, group_id, policy_version, ts) -> None:
        e = s.get(execution_id)
        e.task_id, e.group_id, e.policy_version, e.queued_us = task_id, group_id, policy_version, ts

    @on("execution_started", "execution_id", "cell_id", "ts")
    def _started(self, s: ExecutionsState, execution_id, cell_id, ts) -> None:
        e = s.get(execution_id)
        e.status, e.cell_id, e.started_us = "running", cell_id, ts

    @on("execution_finished", "execution_id", "status", "duration_s", "ts")
    def _finished(self, s: ExecutionsState, execution_id, status, duration_s, ts) -> None:
        e = s.get(execution_id)
        e.status, e.duration_s, e.finished_us = status, duration_s, ts

    @on("model_call_finished", "execution_id", "output_ids#len")
    def _call(self, s: ExecutionsState, execution_id, output_tokens) -> None:
        e = s.executions.get(execution_id) or s.get(execution_id)  # the hot handler: skip a call
        e.calls += 1
        e.output_tokens += output_tokens

    @on("reward_recorded", "execution_id", "reward", "partial")
    def _reward(self, s: ExecutionsState, execution_id, reward, partial) -> None:
        e = s.get(execution_id)
        e.reward, e.reward_partial = reward, partial

    @on("evaluation_failed", "execution_id", "error")
    def _evaluation_failed(self, s: ExecutionsState, execution_id, error) -> None:
        s.get(execution_id).evaluation_error = error
