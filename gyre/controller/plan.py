"""What the controller does besides the policy's role switches: queue a step's rollouts, train a step.

Pure functions of the scheduler view, like the policies (no clock, no I/O), so a resumed controller that
folds the same log reaches the same plan. Rules:
- Step ``s`` is queued once step ``s - 1 - staleness`` has been trained (on-policy at staleness 0: the
  rollouts of step ``s`` wait for the weights of step ``s - 1``), steps in order, ``steps`` of them.
- The core trains the lowest untrained step once every execution of its batch is done (scored, excluded
  or failed), and only while it is settled in the training role with no train step open and no other cell
  on its way to training (a cell the policy lends joins the step rather than missing it: its switch takes
  seconds, a step's micro-steps may take less). Live runs train whole steps; streaming micro-steps of
  incomplete batches is the simulator's ablation.
- The run is finished when every step is trained and the last version is published.
"""

from dataclasses import dataclass

from gyre.scheduler import SchedulerView


@dataclass(frozen=True)
class RunPlan:
    steps: int
    staleness: int = 0


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


def next_step_to_train(view: SchedulerView) -> int | None:
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
    return step if work.executions and not work.group_sizes else None


def step_groups(view: SchedulerView, step: int) -> tuple[str, ...]:
    """The groups of a step's batch, in the order they completed."""
    return tuple(view.work.steps[step].complete_groups)


def finished(view: SchedulerView, plan: RunPlan) -> bool:
    trainer = view.trainer
    return (all(s in view.work.trained for s in range(plan.steps))
            and (trainer.policy_version == 0 or trainer.published_version == trainer.policy_version))
