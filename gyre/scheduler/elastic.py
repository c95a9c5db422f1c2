"""The elastic policy: cells lend themselves to whichever side has work.

Invariants of both versions (tested on hand-built views):
- A rollout cell leaves for training only when training has work and the cells that stay can still serve
  every running and queued execution with ``hysteresis_slots`` to spare. The core leaves first (it owns the
  weights); satellites follow only once the core is training or on its way, fewest in-flight calls first.
- When the watermark exceeds rollout capacity, training cells return until capacity covers it: idle
  satellites first, then busy ones, the core last and never while it owns an open train step.
- Leaving needs ``capacity - slots >= watermark + hysteresis`` (or no rollout work at all); returning needs
  ``watermark > capacity``, so a cell that just left cannot be called back until the watermark rises by
  more than the hysteresis.

``elastic/2`` adds switch-cost awareness (elastic/1 ignores what a switch costs, so with slow switches it
loses to the static baselines). Every estimate comes from the view — means measured in the log, or the
params' priors before the first measurement — so it stays pure and replayable:
- A loan must pay for its round trip: a cell leaves rollout only if the training it can expect to do,
  ``remaining micro-steps x mean micro-step time / training cells``, is at least its switch to training,
  its weight pull (satellites) and its later switch back. The core is exempt: someone must lead training
  (satellites only follow it, so before a core restart no other cell trains while it serves). Before any
  micro-step is measured the gain is unknown and the cell leaves.
- A recall must pay for itself: a training cell returns only if the queue the rollout cells would take
  to absorb without it, ``shortfall x mean execution time / rollout capacity``, is longer than a round
  trip. With no rollout capacity at all a cell always returns (else nothing could run). Cells already
  on their way back count as capacity (elastic/1 recalls again while they travel).
- ``migrate=False`` keeps a cell in rollout until it holds no execution (the ablation without migration).
With cheap switches these guards pass and elastic/2 decides like elastic/1; with switches of hours it
settles into a fixed split after the first step, which is what the better baseline does.
"""

from dataclasses import dataclass

from gyre.events.models import RoleSwitchRequested
from gyre.scheduler.decisions import free_slots, leave_rollout, to_rollout
from gyre.scheduler.params import ElasticParams
from gyre.scheduler.policy import Policy, all_rollout
from gyre.scheduler.view import SchedulerView
from gyre.state import Cell


@dataclass(frozen=True)
class SwitchCosts:
    """What the policy expects a switch to cost: measured means from the log, else the params' priors."""

    to_training_s: float
    to_rollout_s: float
    join_s: float

    @classmethod
    def of(cls, view: SchedulerView, params: ElasticParams) -> "SwitchCosts":
        work = view.work

        def measured(what: str, prior: float) -> float:
            mean = work.mean(what)
            return prior if mean is None else mean

        return cls(measured("to_training", params.switch_to_training_s),
                   measured("to_rollout", params.switch_to_rollout_s), measured("join", params.satellite_join_s))

    def round_trip(self, cell: Cell) -> float:
        return self.to_training_s + self.to_rollout_s + (0.0 if cell.is_core else self.join_s)


def decide(view: SchedulerView, params: ElasticParams) -> list[RoleSwitchRequested]:
    """elastic/1: lend whenever capacity allows, ignoring what a switch costs."""
    rollout = view.cells_in("rollout")
    capacity = view.capacity(rollout)
    watermark = view.watermark
    if watermark > capacity:
        return _return_to_rollout(view, watermark - capacity)
    if not view.training_pending:
        return []
    return _lend_to_training(view, rollout, capacity, watermark, params.hysteresis_slots)


def decide_v2(view: SchedulerView, params: ElasticParams) -> list[RoleSwitchRequested]:
    """elastic/2: as elastic/1, but a switch happens only when its expected gain exceeds its cost."""
    rollout = view.cells_in("rollout")
    capacity = view.capacity(rollout)
    watermark = view.watermark
    costs = SwitchCosts.of(view, params)
    coming = view.capacity(view.entering("rollout"))  # already on their way back: count them as served
    if watermark > capacity + coming:
        return _return_to_rollout(view, watermark - capacity - coming, costs=costs, capacity=capacity + coming)
    if not view.training_pending:
        return []
    return _lend_to_training(view, rollout, capacity, watermark, params.hysteresis_slots, costs=costs,
                             migrate=params.migrate)


def _training_gain(view: SchedulerView, cell: Cell, training: int) -> float | None:
    """Seconds of training ``cell`` can expect to do if it joins ``training`` other training cells."""
    micro_s = view.work.mean("micro_step")
    if micro_s is None:
        return None
    work = view.work
    pending = len(work.steps) - len(work.trained)
    current = view.trainer.current
    done = len(current.claimed) if current is not None and not current.closed else 0
    remaining = max(0, pending * work.planned_micro_steps - done)
    return remaining * micro_s / (training + 1)


def _lend_to_training(view: SchedulerView, rollout: list[Cell], capacity: int, watermark: int,
                      hysteresis: int, costs: SwitchCosts | None = None,
                      migrate: bool = True) -> list[RoleSwitchRequested]:
    """Pick the cells that may leave first, then redirect their calls into the cells that stay."""
    core = view.core
    if core is None:
        return []  # no core to lead a step: satellites would have nothing to join
    leaving: list[Cell] = []
    training = len(view.cells_in("training")) + len(view.entering("training"))

    def fits(cell: Cell) -> bool:
        rest = capacity - sum(c.slots for c in leaving) - cell.slots
        return watermark <= rest and (watermark == 0 or watermark + hysteresis <= rest)

    def pays(cell: Cell) -> bool:
        if costs is None:
            return True
        if not migrate and (view.load(cell.cell_id) or view.cluster.inflight(cell.cell_id)):
            return False
        if cell.is_core:
            return True  # someone must lead training; satellites cannot train without it (after a restart of the
            # core they may be waiting in training for it: before restarts, no cell trained while the core served)
        gain = _training_gain(view, cell, training + len(leaving))
        return gain is None or gain >= costs.round_trip(cell)

    if any(c.cell_id == core.cell_id for c in rollout):
        if not (fits(core) and pays(core)):
            return []  # satellites only ever follow the core
        leaving.append(core)
    elif not (core.role == "training" or core.switching_to == "training"):
        return []
    for cell in sorted((c for c in rollout if not c.is_core), key=lambda c: (view.load(c.cell_id), c.cell_id)):
        if fits(cell) and pays(cell):
            leaving.append(cell)
    if not leaving:
        return []
    gone = {c.cell_id for c in leaving}
    staying = [c for c in rollout if c.cell_id not in gone]
    free = free_slots(view, staying)
    remaining = view.capacity(staying)
    reason = f"remaining rollout capacity {remaining} serves watermark {watermark}"
    return [leave_rollout(view, cell, staying, free, reason) for cell in leaving]


def _return_to_rollout(view: SchedulerView, shortfall: int, costs: SwitchCosts | None = None,
                       capacity: int = 0) -> list[RoleSwitchRequested]:
    busy = view.busy_training()
    training = view.cells_in("training")
    satellites = sorted((c for c in training if not c.is_core), key=lambda c: (c.cell_id in busy, c.cell_id))
    decisions = []
    reason = f"watermark {view.watermark} above rollout capacity"
    execution_s = view.work.mean("execution") if costs is not None else None

    def worth(cell: Cell) -> bool:
        if costs is None or capacity <= 0 or execution_s is None:
            return True
        return shortfall * execution_s / capacity > costs.round_trip(cell)

    for cell in satellites:
        if shortfall <= 0 or not worth(cell):
            return decisions
        decisions.append(to_rollout(view, cell, reason))
        shortfall -= cell.slots
        capacity += cell.slots
    core = next((c for c in training if c.is_core), None)
    satellites_arriving = bool(view.entering("training"))
    if shortfall > 0 and core is not None and view.open_step is None and not satellites_arriving and worth(core):
        decisions.append(to_rollout(view, core, reason))
    return decisions


ELASTIC_V1 = Policy(name="elastic", version="elastic/1", params_type=ElasticParams, decide=decide,
                    initial_roles=all_rollout)
ELASTIC = Policy(name="elastic", version="elastic/2", params_type=ElasticParams, decide=decide_v2,
                 initial_roles=all_rollout)
