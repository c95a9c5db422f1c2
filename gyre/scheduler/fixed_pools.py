"""The async baseline: fixed rollout and training pools, bounded staleness.

The training pool is the core plus the lowest-id other cells, ``training_cells`` in all; it is set at
registration and only re-asserted if a cell's role drifts (e.g. after a cell is lost). Neither pool ever
lends idle capacity to the other, which is the cost the elastic policy removes.
"""

from collections.abc import Iterable, Sequence
from typing import Any

from gyre.events.fields import Role
from gyre.events.models import RoleSwitchRequested
from gyre.scheduler.decisions import free_slots, leave_rollout, to_rollout
from gyre.scheduler.params import AsyncParams
from gyre.scheduler.policy import CellSpec, Policy
from gyre.scheduler.view import SchedulerView


def training_pool(cells: Iterable[tuple[str, bool]], size: int) -> set[str]:
    """Ids of the training pool: the core first, then the lowest ids."""
    ordered = sorted(cells, key=lambda c: (not c[1], c[0]))
    return {cell_id for cell_id, _ in ordered[:size]}


def decide(view: SchedulerView, params: AsyncParams) -> list[RoleSwitchRequested]:
    live = sorted((c for c in view.cluster.cells.values() if not c.lost), key=lambda c: c.cell_id)
    pool = training_pool(((c.cell_id, c.is_core) for c in live), params.training_cells)
    rollout = view.cells_in("rollout")
    staying = [c for c in rollout if c.cell_id not in pool]
    free = free_slots(view, staying)
    decisions = []
    for cell in live:
        target = cell.switching_to or cell.role
        if cell.cell_id in pool and target == "rollout":
            decisions.append(leave_rollout(view, cell, staying, free, "fixed training pool"))
        elif cell.cell_id not in pool and target == "training":
            decisions.append(to_rollout(view, cell, "fixed rollout pool"))
    return decisions


def initial_roles(cells: Sequence[CellSpec], params: Any) -> dict[str, Role]:
    pool = training_pool(((c.cell_id, c.is_core) for c in cells), params.training_cells)
    return {c.cell_id: "training" if c.cell_id in pool else "rollout" for c in cells}


ASYNC = Policy(name="async", version="async/1", params_type=AsyncParams, decide=decide,
               initial_roles=initial_roles)
