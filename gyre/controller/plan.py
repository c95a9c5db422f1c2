"""What the controller does besides the policy's role switches: queue a step's rollouts, train a step.

Pure functions of the scheduler view, like the policies (no clock, no I/O), so a resumed controller that
folds the same log reaches the same plan. Rules:
- Step ``s`` is queued once step ``s - 1 - staleness`` has been trained (on-policy at staleness 0: the
  rollouts of step ``s`` wait for the weights of step ``s - 1``), steps in order, ``steps`` of them.
- The core trains the lowest untrained step once every execution of its batch is done (scored, excluded
  or failed) — with ``stream`` (the policy's ``stream_micro_steps``), once its first group is — and only
  while it is settled in the training role with no train step open and — unless ``wait_for_lent`` is off
  — no other cell on its way to training (a cell the policy lends joins the step rather than missing it:
  its switch takes seconds, a toy step's micro-steps less; off, as `gyre sim` models it, a lent cell claims
  what is left of the open step when it arrives). A streamed step is handed every group of its batch, the complete ones
  first in completion order: the core trains each of the others as it completes (`gyre.trainer.core`).
- The run is finished when every step is trained and the last version is published.

Partial rollouts (the policy's ``partial_rollouts`` and ``oversample_groups``, as `gyre sim` models them:
`gyre.sim.training`): step ``s`` is queued with the first ``oversample`` groups of batch ``s + 1`` (those
are left out when ``s + 1`` is queued), so a batch counts as queued once all its executions are; a step
trains the groups `WorkState.assignable` gives it — due carried groups first, then the first complete ones
of batches up to ``s + 1`` — not necessarily its own batch's, and the rest are carried to a later step. The
core starts step ``s`` once those groups fill its batch (live, a partial step's groups are fixed when it
starts: the trainer is handed exactly the groups the log's fold assigns it; the simulator may also stream
a partial step before it is full). Executions still running are cut only where a policy lets a cell leave
rollout without redirecting them (`gyre.cluster.actuator`).
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
    partial: bool = False
    """Partial rollouts (`PolicyParams.partial_rollouts`): steps train the groups the fold assigns them."""
    oversample: int = 0
    """Groups of the next batch queued with each batch (`PolicyParams.oversample_groups`; partial only)."""
    batch_executions: int = 0
    """Executions of one step's batch (groups x group size): with over-sampling a batch is queued once its
    every execution is. 0: a step is queued once any of its executions is (without over-sampling, the same)."""
    groups: int = 0
    """Groups one step trains (partial rollouts; 0: the first queued batch's)."""
    wait_for_lent: bool = True
    """Hold a step's start while a cell is on its way to training (``scheduler.wait_for_lent_cells``)."""

    def __post_init__(self) -> None:
        if self.oversample and not self.partial:
            raise ValueError("oversample_groups needs partial_rollouts")
        if self.oversample and not (self.batch_executions and self.groups):
            raise ValueError("over-sampling needs groups and batch_executions: a batch is queued once all of it is")
        if 2 * self.oversample > self.groups:
            raise ValueError(f"oversample_groups ({self.oversample}) may be at most half a batch "
                             f"({self.groups} groups)")


def batch_parts(plan: RunPlan, step: int) -> list[tuple[int, range]]:
    """What queueing ``step`` queues, as (batch, indices of its groups in the step's plan): its own batch but
    the groups that went with the batch before, then the first ``oversample`` groups of the next batch."""
    if not plan.oversample:
        return [(step, range(plan.groups))]
    parts = [(step, range(plan.oversample if step > 0 else 0, plan.groups))]
    if step + 1 < plan.steps:
        parts.append((step + 1, range(plan.oversample)))
    return parts


def queued_steps(view: SchedulerView) -> list[int]:
    return sorted(s for s in view.work.steps if s >= 0)


def next_step_to_queue(view: SchedulerView, plan: RunPlan) -> int | None:
    queued = queued_steps(view)
    if plan.oversample:  # a batch whose over-sampled groups went with the one before is not queued yet
        queued = [s for s in queued if view.work.steps[s].executions >= plan.batch_executions]
    step = queued[-1] + 1 if queued else 0
    if step >= plan.steps:
        return None
    needed = step - 1 - plan.staleness
    if needed >= 0 and needed not in view.work.trained:
        return None
    return step


def next_step_to_train(view: SchedulerView, stream: bool = False, plan: RunPlan | None = None) -> int | None:
    """The step the core may start now, or None (rules in the module docstring; ``plan``: partial rollouts)."""
    core = view.core
    if core is None or core.role != "training" or core.switching_to not in (None, "training"):
        return None
    if view.open_step is not None:
        return None
    if view.entering("training") and (plan is None or plan.wait_for_lent):
        return None
    if plan is not None and plan.partial:
        step = view.work.next_train_step()
        if step >= plan.steps or step in view.work.trained:
            return None
        return step if view.work.assignable(step, _groups(view, plan))[1] else None
    waiting = [s for s in queued_steps(view) if s not in view.work.trained]
    if not waiting:
        return None
    step = waiting[0]
    work = view.work.steps[step]
    if stream:
        return step if work.complete_groups else None
    return step if work.executions and not work.group_sizes else None


def step_groups(view: SchedulerView, step: int, plan: RunPlan | None = None) -> tuple[str, ...]:
    """The groups a step trains: with partial rollouts those the fold assigned it (a step that has started:
    retrained after a crash) or would assign it now (``plan``: it starts now); else its batch's, those
    complete, in the order they completed, then those still running."""
    work = view.work
    if work.partial_rollouts:
        if step in work.assigned:
            return tuple(work.assigned[step])
        if plan is not None:
            return tuple(work.assignable(step, _groups(view, plan))[0])
    batch = work.steps[step]
    return (*batch.complete_groups, *batch.group_sizes)


def _groups(view: SchedulerView, plan: RunPlan) -> int:
    return plan.groups or view.work.batch_groups()


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
