"""The colocate baseline: the whole cluster alternates between rolling out and training.

Every cell rolls out until the step's batch is complete (watermark 0), then every cell trains; once the
step is finished and the next batch is queued, every cell returns to rollout. The cluster therefore waits
for the slowest execution of each batch, which is exactly the cost the elastic policy attacks.

With ``partial_rollouts`` (slime's design: colocated, with over-sampling) the cluster trains as soon as
the next step's batch is full (``WorkState.assignable``), and the executions still running are cut, to
continue when the cluster rolls out again. Without it decisions are exactly colocate/1's.
"""

from gyre.events.models import RoleSwitchRequested
from gyre.scheduler.decisions import free_slots, leave_rollout, to_rollout
from gyre.scheduler.params import ColocateParams
from gyre.scheduler.policy import Policy, all_rollout
from gyre.scheduler.view import SchedulerView


def decide(view: SchedulerView, params: ColocateParams) -> list[RoleSwitchRequested]:
    rollout = view.cells_in("rollout")
    training = view.cells_in("training")
    if view.entering("rollout") or view.entering("training"):
        return []  # a phase change is under way: let it finish
    if params.partial_rollouts:
        work = view.work
        groups = work.batch_groups()
        full = groups > 0 and work.open_train is None and work.assignable(work.next_train_step(), groups)[1]
        if full or (view.watermark == 0 and view.training_pending):  # train now (or stay training)
            return [RoleSwitchRequested(cell_id=cell.cell_id, from_role="rollout", to_role="training",
                                        reason="next batch full: the whole cluster trains, the rest is cut",
                                        watermark=view.watermark) for cell in rollout]
    elif view.watermark == 0 and view.training_pending and rollout:
        free = free_slots(view, rollout)
        return [leave_rollout(view, cell, [], free, "batch complete: the whole cluster trains") for cell in rollout]
    if view.watermark > 0 and view.open_step is None and training:
        return [to_rollout(view, cell, "step trained: the whole cluster rolls out") for cell in training]
    return []


COLOCATE = Policy(name="colocate", version="colocate/1", params_type=ColocateParams, decide=decide,
                  initial_roles=all_rollout)
