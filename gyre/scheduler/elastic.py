"""The elastic policy: cells lend themselves to whichever side has work.

Invariants (tested on hand-built views):
- A rollout cell leaves for training only when training has work and the cells that stay can still serve
  every running and queued execution with ``hysteresis_slots`` to spare. The core leaves first (it owns the
  weights); satellites follow only once the core is training or on its way, fewest in-flight calls first.
- When the watermark exceeds rollout capacity, training cells return until capacity covers it: idle
  satellites first, then busy ones, the core last and never while it owns an open train step.
- Leaving needs ``capacity - slots >= watermark + hysteresis`` (or no rollout work at all); returning needs
  ``watermark > capacity``, so a cell that just left cannot be called back until the watermark rises by
  more than the hysteresis.
"""

from gyre.events.models import RoleSwitchRequested
from gyre.scheduler.decisions import free_slots, leave_rollout, to_rollout
from gyre.scheduler.params import ElasticParams
from gyre.scheduler.policy import Policy, all_rollout
from gyre.scheduler.view import SchedulerView
from gyre.state import Cell


def decide(view: SchedulerView, params: ElasticParams) -> list[RoleSwitchRequested]:
    rollout = view.cells_in("rollout")
    capacity = view.capacity(rollout)
    watermark = view.watermark
    if watermark > capacity:
        return _return_to_rollout(view, watermark - capacity)
    if not view.training_pending:
        return []
    return _lend_to_training(view, rollout, capacity, watermark, params.hysteresis_slots)


def _lend_to_training(view: SchedulerView, rollout: list[Cell], capacity: int, watermark: int,
                      hysteresis: int) -> list[RoleSwitchRequested]:
    """Pick the cells that may leave first, then redirect their calls into the cells that stay."""
    core = view.core
    if core is None:
        return []  # no core to lead a step: satellites would have nothing to join
    leaving: list[Cell] = []

    def fits(cell: Cell) -> bool:
        rest = capacity - sum(c.slots for c in leaving) - cell.slots
        return watermark <= rest and (watermark == 0 or watermark + hysteresis <= rest)

    if any(c.cell_id == core.cell_id for c in rollout):
        if not fits(core):
            return []  # satellites only ever follow the core
        leaving.append(core)
    elif not (core.role == "training" or core.switching_to == "training"):
        return []
    for cell in sorted((c for c in rollout if not c.is_core), key=lambda c: (view.load(c.cell_id), c.cell_id)):
        if fits(cell):
            leaving.append(cell)
    if not leaving:
        return []
    gone = {c.cell_id for c in leaving}
    staying = [c for c in rollout if c.cell_id not in gone]
    free = free_slots(view, staying)
    remaining = view.capacity(staying)
    reason = f"remaining rollout capacity {remaining} serves watermark {watermark}"
    return [leave_rollout(view, cell, staying, free, reason) for cell in leaving]


def _return_to_rollout(view: SchedulerView, shortfall: int) -> list[RoleSwitchRequested]:
    busy = view.busy_training()
    training = view.cells_in("training")
    satellites = sorted((c for c in training if not c.is_core), key=lambda c: (c.cell_id in busy, c.cell_id))
    decisions = []
    reason = f"watermark {view.watermark} above rollout capacity"
    for cell in satellites:
        if shortfall <= 0:
            return decisions
        decisions.append(to_rollout(view, cell, reason))
        shortfall -= cell.slots
    core = next((c for c in training if c.is_core), None)
    satellites_arriving = bool(view.entering("training"))
    if shortfall > 0 and core is not None and view.open_step is None and not satellites_arriving:
        decisions.append(to_rollout(view, core, reason))
    return decisions


ELASTIC = Policy(name="elastic", version="elastic/1", params_type=ElasticParams, decide=decide,
                 initial_roles=all_rollout)
