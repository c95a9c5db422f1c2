"""Held-out evaluation: the current policy runs tasks it never trains on, and the log gets its pass rate.

Every ``every`` steps (and for the initial and the final policy) the loop hands the evaluator the policy
version the engine serves. The evaluator runs ``samples`` executions of each held-out task through the same
proxy and harness runner as training, scores them with the tasks' evaluators, and appends one
``heldout_evaluated`` event. Its executions are ordinary executions in the log (calls, rewards) under
groups named ``heldout-s{step}-{task}``: the training loop builds batches only from the groups of its own
step, so nothing here is ever trained on. An evaluator failure is excluded, never a failed pass.

Nothing here knows the proxy or the log: registration and recording are callables the loop passes in.
"""

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from gyre.errors import ConfigError
from gyre.events.models import Event, HeldOutEvaluated
from gyre.harness.runner import Execution, ExecutionResult
from gyre.harness.tasks import TaskSet

GROUP_PREFIX = "heldout-"


@dataclass(frozen=True)
class HeldOutPlan:
    """Which tasks, how often, how many samples, and what counts as a pass."""

    every: int
    task_ids: tuple[str, ...]
    samples: int
    pass_threshold: float

    def due(self, steps_done: int, total_steps: int) -> bool:
        """Evaluate before step ``steps_done`` (0: the initial policy) and after the last step."""
        return self.every > 0 and (steps_done % self.every == 0 or steps_done == total_steps)


def plan_heldout(
    every: int, tasks: TaskSet, task_ids: Sequence[str], trained: Sequence[str], samples: int, pass_threshold: float
) -> HeldOutPlan:
    """Check the held-out tasks: they exist, and none of them is trained on (``trained``: the task ids the
    rollouts use). With no ``task_ids``, every task of the set that training leaves out is held out."""
    known = [t.id for t in tasks]
    chosen = tuple(task_ids) or tuple(t for t in known if t not in set(trained))
    if every == 0:
        return HeldOutPlan(0, chosen, samples, pass_threshold)
    unknown = [t for t in chosen if t not in known]
    if unknown:
        raise ConfigError(f"evaluation.task_ids names unknown task(s) {unknown}; the task set has {known}")
    overlap = sorted(set(chosen) & set(trained))
    if overlap:
        raise ConfigError(f"evaluation.task_ids {overlap} are also trained on (rollout.task_ids): held-out tasks "
                          "must not be")
    if not chosen:
        raise ConfigError("evaluation.every is set but no task is held out: rollout.task_ids trains on the whole "
                          "task set; name evaluation.task_ids or evaluation.tasks")
    return HeldOutPlan(every, chosen, samples, pass_threshold)


def summarize(results: Sequence[ExecutionResult], plan: HeldOutPlan, *, step: int, policy_version: int,
              duration_s: float) -> HeldOutEvaluated:
    """The event for a finished evaluation (pure): pass rate and mean reward over the scored executions."""
    rewards = [r.reward for r in results if r.reward is not None]
    passed = sum(reward >= plan.pass_threshold for reward in rewards)
    return HeldOutEvaluated(
        step=step, policy_version=policy_version, tasks=len(plan.task_ids), executions=len(results),
        scored=len(rewards), passed=passed, pass_threshold=plan.pass_threshold,
        pass_rate=passed / len(rewards) if rewards else None,
        reward_mean=sum(rewards) / len(rewards) if rewards else None,
        duration_s=duration_s, group_prefix=f"{GROUP_PREFIX}s{step}-",
    )


class HeldOutEvaluator:
    """Runs the held-out plan with the loop's runner; ``register`` returns an execution's proxy token."""

    def __init__(
        self,
        plan: HeldOutPlan,
        tasks: TaskSet,
        *,
        submit: Callable[[Execution], Future[ExecutionResult]],
        register: Callable[[str, int], str],
        unregister: Callable[[str], None],
        record: Callable[[Event], object],
        cell_id: str | None = None,
    ) -> None:
        self.plan = plan
        self.tasks = tasks
        self._submit, self._register, self._unregister, self._record = submit, register, unregister, record
        self.cell_id = cell_id

    def maybe_run(self, steps_done: int, total_steps: int, policy_version: int) -> HeldOutEvaluated | None:
        """Evaluate if the plan says so at this point of the run; returns the event it recorded."""
        if not self.plan.due(steps_done, total_steps):
            return None
        return self.run(steps_done, policy_version)

    def run(self, step: int, policy_version: int) -> HeldOutEvaluated:
        started = time.monotonic()
        executions = []
        for task_id in self.plan.task_ids:
            group_id = f"{GROUP_PREFIX}s{step}-{task_id}"
            for i in range(self.plan.samples):
                execution_id = f"{group_id}-e{i}"
                token = self._register(execution_id, policy_version)
                executions.append(Execution(execution_id, self.tasks[task_id], group_id=group_id, token=token,
                                            policy_version=policy_version, cell_id=self.cell_id))
        try:
            results = [f.result() for f in [self._submit(e) for e in executions]]
        finally:
            for execution in executions:
                self._unregister(execution.execution_id)
        event = summarize(results, self.plan, step=step, policy_version=policy_version,
                          duration_s=time.monotonic() - started)
        self._record(event)
        return event
