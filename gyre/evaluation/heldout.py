"""Held-out evaluation: the current policy runs tasks it never trains on, and the log gets its pass rate.

Every ``every`` steps (and for the initial and the final policy) the run host (`gyre.run.host`) queues
``samples`` executions of each held-out task through the same proxy and harness runner as training, with the
version to evaluate; the tasks' evaluators score them, and once the log holds every outcome the host appends
one ``heldout_evaluated`` event. Its executions are ordinary executions in the log (calls, rewards) under
groups named ``heldout-s{step}-{task}``: the training loop builds batches only from the groups of its own
step, so nothing here is ever trained on. An evaluator failure is excluded, never a failed pass.

Pure: the plan, the executions and the event; queuing and waiting are the host's.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from gyre.errors import ConfigError
from gyre.events.models import HeldOutEvaluated
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


def heldout_executions(plan: HeldOutPlan, steps_done: int) -> list[tuple[str, str, str]]:
    """The executions of the evaluation before step ``steps_done``, as (execution, group, task): ``samples``
    of each held-out task, in groups ``heldout-s{steps_done}-{task}`` that no step's batch ever includes."""
    out = []
    for task_id in plan.task_ids:
        group_id = f"{GROUP_PREFIX}s{steps_done}-{task_id}"
        out += [(f"{group_id}-e{i}", group_id, task_id) for i in range(plan.samples)]
    return out


def summarize(rewards: Sequence[float | None], plan: HeldOutPlan, *, step: int, policy_version: int,
              duration_s: float) -> HeldOutEvaluated:
    """The event for a finished evaluation (pure): pass rate and mean reward over the scored executions
    (``None``: excluded, its evaluator or harness failed; never a failed pass)."""
    scored = [r for r in rewards if r is not None]
    passed = sum(reward >= plan.pass_threshold for reward in scored)
    return HeldOutEvaluated(
        step=step, policy_version=policy_version, tasks=len(plan.task_ids), executions=len(rewards),
        scored=len(scored), passed=passed, pass_threshold=plan.pass_threshold,
        pass_rate=passed / len(scored) if scored else None,
        reward_mean=sum(scored) / len(scored) if scored else None,
        duration_s=duration_s, group_prefix=f"{GROUP_PREFIX}s{step}-",
    )
