"""Building role-switch decisions, including where a leaving cell's in-flight calls go.

Redirect targets are chosen so that no rollout cell is pushed over its slots: each in-flight call (one per
running execution on the cell) goes to the remaining rollout cell with the most free slots, lowest id first.
"""

from collections.abc import Callable

from gyre.events.models import Redirect, RoleSwitchRequested
from gyre.scheduler.view import SchedulerView
from gyre.state import Cell


class InsufficientCapacityError(RuntimeError):
    """A policy tried to empty a rollout cell whose work the remaining cells cannot hold (a policy bug)."""


def to_rollout(view: SchedulerView, cell: Cell, reason: str) -> RoleSwitchRequested:
    return RoleSwitchRequested(cell_id=cell.cell_id, from_role=cell.role, to_role="rollout", reason=reason,
                               watermark=view.watermark)


def leave_rollout(view: SchedulerView, cell: Cell, remaining: list[Cell], free: dict[str, int],
                  reason: str, keep: Callable[[str], bool] | None = None) -> RoleSwitchRequested:
    """Switch ``cell`` to training, redirecting its in-flight calls into ``free`` slots of ``remaining``.

    ``remaining`` must be sorted by id. ``free`` (cell -> free slots) is updated in place, so several
    departures in one decision round share it. With ``keep`` (partial rollouts) only the calls of
    executions it accepts are redirected; the others are cut when the cell leaves.
    """
    redirects = []
    for call_id in view.cluster.inflight(cell.cell_id):
        execution_id = view.work.call_execution.get(call_id, "")
        if keep is not None and not keep(execution_id):
            continue
        target = max(remaining, key=lambda c: free[c.cell_id], default=None)  # first of equals: lowest id
        if target is None or free[target.cell_id] <= 0:
            raise InsufficientCapacityError(
                f"cell {cell.cell_id} cannot leave rollout: no free slot left for call {call_id}")
        free[target.cell_id] -= 1
        redirects.append(Redirect(call_id=call_id, execution_id=execution_id, to_cell_id=target.cell_id))
    return RoleSwitchRequested(cell_id=cell.cell_id, from_role="rollout", to_role="training", reason=reason,
                               watermark=view.watermark, redirects=redirects)


def free_slots(view: SchedulerView, cells: list[Cell]) -> dict[str, int]:
    return {c.cell_id: c.slots - view.load(c.cell_id) for c in cells}
