"""What the controller does besides the policy's role switches: queue a step's rollouts, train a step.

Pure functions of the scheduler view, like the policies (no clock, no I/O), so a resumed controller that
folds the same log reaches the same plan. Rules:
- Step ``s`` is queued once step ``s - 1 - staleness`` has been trained (on-policy at staleness 0: the
  rollouts of step ``s`` wait for the weights of step ``s - 1``), steps in order, ``steps`` of them.
- The core trains the lowest untrained step once every execution of its batch is done (scored, excluded
  or failed) — with ``stream`` (the policy's ``stream_micro_steps``), once its first group is — and only
  while it is settled in the training role with no train step open and no other cell on its way to
  training (a cell the policy lends joins the step rather than missing it: its switch takes seconds, a
  step's micro-steps may take less). A streamed step is handed every group of its batch, the complete ones
  first in completion order: the core trains each of the others as it completes (`gyre.trainer.core`).
- The run is finished when every step is trained and the last version is published.
"""

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from gyre.scheduler import SchedulerView


@dataclass(frozen=True)
class RunPlan:
    steps: int
    staleness: int = 0
    stream: bool = False
    """Start a step on its first complete group (`PolicyParams.stream_micro_steps`, where the trainer can:
    its plan needs ``trajectory.micro_steps_per_group``)."""


def queued_steps(view: SchedulerView) -> list[int]:
    return sorted(s for s in view.work.steps if s >= 0)


def next_step_to_queue(view: SchedulerView, plan: RunPlan) -> int | None:
    queued = queued_steps(view)
    step = queued[-1] + 1 if queued else 0
    if step >= plan.steps:
        return None
    needed = step - 1 - plan.staleness
    if needed >= 0 and needed not in view.work.trained:
        return None
    return step


def next_step_to_train(view: SchedulerView, stream: bool = False) -> int | None:
    core = view.core
    if core is None or core.role != "training" or core.switching_to not in (None, "training"):
        return None
    if view.open_step is not None:
        return None
    if view.entering("training"):
        return None
    waiting = [s for s in queued_steps(view) if s not in view.work.trained]
    if not waiting:
        return None
    step = waiting[0]
    work = view.work.steps[step]
    if stream:
        return step if work.complete_groups else None
    return step if work.executions and not work.group_sizes else None


def step_groups(view: SchedulerView, step: int) -> tuple[str, ...]:
    """The groups of a step's batch: those complete, in the order they completed, then those still running."""
    work = view.work.steps[step]
    return (*work.complete_groups, *work.group_sizes)


def finished(view: SchedulerView, plan: RunPlan) -> bool:
    trainer = view.trainer
    return (all(s in view.work.trained for s in range(plan.steps))
            and (trainer.policy_version == 0 or trainer.published_version == trainer.policy_version))


@dataclass(frozen=True)
class Resubmit:
    execution_id: str
    group_id: str
    task_id: str
    step: int
    attempt: int


def rollouts_to_resubmit(view: SchedulerView, queued: Mapping[str, tuple[int, str, str, int]],
                         plan: Callable[[int], Iterable[tuple[str, str, str]]],
                         held: Iterable[str] = ()) -> list[Resubmit]:
    """What a crash left without a harness, to submit again.

    ``queued``: each execution the log queued -> (its last attempt, task, group, step); ``plan(step)``: the
    step's (execution, group, task); ``held``: executions a runner that survived the crash still runs.
    Every queued execution that is not scored, of a step not trained, and not held runs again as its next
    attempt (only the last attempt is trained); an execution of a queued step that was never queued (the
    crash came in the middle of queueing it) is queued as attempt 0. A scored execution never runs again.
    """
    held = set(held)
    out: list[Resubmit] = []
    for execution_id in sorted(view.work.execution_group):
        attempt, task_id, group_id, step = queued[execution_id]
        if execution_id not in held and step not in view.work.trained:
            out.append(Resubmit(execution_id, group_id, task_id, step, attempt + 1))
    for step in queued_steps(view):
        if step in view.work.trained:
            continue
        for execution_id, group_id, task_id in plan(step):
            if execution_id not in queued and execution_id not in held:
                out.append(Resubmit(execution_id, group_id, task_id, step, 0))
    return out
