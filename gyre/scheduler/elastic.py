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
from gyre.scheduler.params import ElasticParams, ElasticV3Params, elastic3_values
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
    pending = work.untrained_steps
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


@dataclass(frozen=True)
class Needs:
    """The rollout work the next train step waits on (``WorkState.needed_groups``), as executions."""

    demand: int
    """Queued and running executions of the needed groups: what rollout capacity must serve."""
    running: frozenset[str]
    """Needed executions holding a slot: a cell leaving rollout must redirect these."""
    on_cell: dict[str, int]
    """Cell -> needed executions on it."""

    @classmethod
    def of(cls, view: SchedulerView) -> "Needs":
        work, queued = view.work, view.cluster.queued
        groups = work.needed_groups()
        running, on_cell = set(), {}
        if not groups:
            return cls(0, frozenset(), {})
        located = work.execution_group
        for execution, cell in work.placement.items():
            if located.get(execution, (0, ""))[1] in groups:
                running.add(execution)
                on_cell[cell] = on_cell.get(cell, 0) + 1
        demand = len(running) + sum(1 for e in queued if located.get(e, (0, ""))[1] in groups)
        return cls(demand, frozenset(running), on_cell)


def rate_split(view: SchedulerView) -> int:
    """Training cells that match the measured rates once batches overlap (staleness >= 1).

    Per step, rollout needs ``executions x mean execution / slots per cell`` cell-seconds and training
    ``planned micro-steps x mean micro-step``; with ``n`` cells both keep pace when training holds
    ``n x training / (rollout + training)`` of them (rounded, at least 1, at most ``n - 1``). 0 until
    both are measured: until then elastic/3 lends as elastic/2 does.
    """
    work = view.work
    execution_s, micro_s = work.mean("execution"), work.mean("micro_step")
    live = [c for c in view.cluster.cells.values() if not c.lost]
    if execution_s is None or micro_s is None or not work.planned_micro_steps or len(live) < 2 or not work.steps:
        return 0
    executions = work.steps[min(work.steps)].executions
    rollout_s = executions * execution_s / (view.capacity(live) / len(live))
    training_s = work.planned_micro_steps * micro_s
    return min(len(live) - 1, max(1, round(len(live) * training_s / (rollout_s + training_s))))


def _next_step_gain(view: SchedulerView, training: int) -> float | None:
    """Seconds of training a cell can expect if it joins ``training`` others: the next step's remaining
    micro-steps only (elastic/2 counts every pending step, which overstates it at staleness >= 1)."""
    micro_s = view.work.mean("micro_step")
    if micro_s is None:
        return None
    current = view.trainer.current
    done = len(current.claimed) if current is not None and not current.closed else 0
    return max(0, view.work.planned_micro_steps - done) * micro_s / (training + 1)


def decide_v3(view: SchedulerView, params: ElasticV3Params) -> list[RoleSwitchRequested]:
    """elastic/3: weigh rollout capacity against the work the next train step needs, not the watermark.

    - Demand is the needed executions (``Needs``); training cells return when it exceeds the rollout
      capacity (plus cells on their way back), or when training has nothing to do and the whole
      watermark does (then the rest of the work is worth serving).
    - A cell leaves when training will have work and the cells that stay can serve the demand with
      ``hysteresis_slots`` to spare and hold its needed executions in free slots. With partial rollouts
      (``cut_unneeded``) it redirects only those; the rest are cut and continue later, progress kept.
    - At staleness >= 1 with partial rollouts (``rate_split``) the training cells never fall below
      ``rate_split`` and rollout cells lend to reach it whatever the demand (cutting what the next step
      does not need); elastic lending happens around that split. Without partial rollouts a cell lent to
      the split would have to redirect all its work onto fewer cells, which measured worse (no floor).
    - Every switch must pay for its round trip (elastic/2's guards, with the next step's gain).
    - With partial rollouts, optionally (``backlog_loans``) a satellite's loan pays only from the micro-steps
      it could claim now (complete, unclaimed), not the step's whole remainder, which arrives as groups
      complete; and (``idle_recall``) a joined satellite with nothing to claim returns to serve the queue
      when the queue outlasts its round trip. Both are off by default so logs recorded before them replay.
    - While training has nothing to do now (no open step, no complete group, no busy cell), the recall weighs
      the whole watermark; with ``idle_demand`` (off by default so earlier logs replay) a loan then weighs it
      too, so a cell lent is not recalled as soon as it arrives. Without it, a step's last groups finished but
      not yet scored (their needs are 0, the watermark is not) make the core flap between the roles: found
      live (one cell, `tests/cluster/test_cluster_elastic3.py`: 46 switches in 0.8 s of scoring).
    - Tail placement (``spread_tail``, off by default; staleness 0 only): a loan must leave at least half a
      cell's slots spare, not just ``hysteresis_slots``, so the tail is not packed onto few cells, whose
      decode slows down with their batch: at staleness 0 the next batch waits for this step's weights, so
      the stragglers are the critical path; at staleness >= 1 the next batch overlaps and packing measured
      better.
    """
    rollout = view.cells_in("rollout")
    capacity = view.capacity(rollout)
    costs = SwitchCosts.of(view, params)
    coming = view.capacity(view.entering("rollout"))
    needs = Needs.of(view)
    split = params.rate_split and params.partial_rollouts and params.staleness >= 1
    floor = rate_split(view) if split else 0
    settled = view.cells_in("training")
    training = len(settled) + len(view.entering("training"))
    idle = view.open_step is None and not _training_ready(view, params) and not view.busy_training()
    shortfall = needs.demand - capacity - coming
    if shortfall <= 0 and idle:
        shortfall = view.watermark - capacity - coming
    if shortfall > 0 and settled and training > floor:
        decisions = _return_to_rollout(view, shortfall, costs=costs, capacity=capacity + coming)
        return decisions if capacity + coming == 0 else decisions[:training - floor]
    if params.partial_rollouts and params.idle_recall and training > max(1, floor):
        decisions = _recall_idle(view, costs, capacity + coming, training - max(1, floor))
        if decisions:
            return decisions
    if training >= floor and not view.training_pending:
        return []
    cut = params.partial_rollouts and params.cut_unneeded
    demand = max(needs.demand, view.watermark) if idle and params.idle_demand else needs.demand
    return _lend_v3(view, rollout, needs, demand, params, costs, training, floor, cut)


def _training_ready(view: SchedulerView, params: ElasticV3Params) -> bool:
    """Training has data now. A partial step that does not stream (``stream_micro_steps`` off: it starts
    only once its groups fill its batch; live, every partial step) has data only then, under ``idle_demand``
    (a complete group alone gives a lent cell nothing to train)."""
    work = view.work
    if params.idle_demand and params.partial_rollouts and not params.stream_micro_steps and work.open_train is None:
        return work.assignable(work.next_train_step(), work.batch_groups())[1]
    return work.training_ready()


def _ready_micro_steps(view: SchedulerView) -> int:
    current = view.trainer.current
    claimed = len(current.claimed) if current is not None and not current.closed else 0
    return view.work.ready_micro_steps(claimed)


def _recall_idle(view: SchedulerView, costs: SwitchCosts, capacity: int, most: int) -> list[RoleSwitchRequested]:
    """Idle training satellites (joined, nothing to claim) go back to serve the queue, if it pays."""
    queued = len(view.cluster.queued)
    execution_s = view.work.mean("execution")
    if not queued or execution_s is None or _ready_micro_steps(view) or view.open_step is None:
        return []
    busy = view.busy_training()
    idle = [c for c in view.cells_in("training") if not c.is_core and c.cell_id not in busy]
    out = []
    for cell in idle[:most]:
        if queued * execution_s / max(1, capacity) <= costs.round_trip(cell):
            break
        out.append(to_rollout(view, cell, f"idle in training while {queued} executions are queued"))
        queued -= cell.slots
        capacity += cell.slots
        if queued <= 0:
            break
    return out


def _lend_v3(view: SchedulerView, rollout: list[Cell], needs: Needs, demand: int, params: ElasticV3Params,
             costs: SwitchCosts, training: int, floor: int, cut: bool) -> list[RoleSwitchRequested]:
    core = view.core
    if core is None:
        return []
    leaving: list[Cell] = []

    def moving(cell: Cell) -> int:
        return needs.on_cell.get(cell.cell_id, 0) if cut else view.load(cell.cell_id)

    def fits(cell: Cell) -> bool:
        gone = {c.cell_id for c in leaving} | {cell.cell_id}
        staying = [c for c in rollout if c.cell_id not in gone]
        free = sum(c.slots - view.load(c.cell_id) for c in staying)
        if sum(moving(c) for c in (*leaving, cell)) > free:
            return False
        if training + len(leaving) < floor:
            return True
        rest = view.capacity(staying)
        spread = params.spread_tail and not params.staleness
        spare = max(params.hysteresis_slots, cell.slots // 2) if spread else params.hysteresis_slots
        return demand <= rest and (demand == 0 or demand + spare <= rest)

    def pays(cell: Cell) -> bool:
        if not params.migrate and moving(cell):
            return False
        if cell.is_core or training + len(leaving) < floor:
            return True
        if params.partial_rollouts and params.backlog_loans:
            micro_s = view.work.mean("micro_step")
            if micro_s is not None:
                return _ready_micro_steps(view) * micro_s / (training + len(leaving) + 1) >= costs.round_trip(cell)
        gain = _next_step_gain(view, training + len(leaving))
        return gain is None or gain >= costs.round_trip(cell)

    if any(c.cell_id == core.cell_id for c in rollout):
        if not (fits(core) and pays(core)):
            return []
        leaving.append(core)
    elif not (core.role == "training" or core.switching_to == "training"):
        return []
    for cell in sorted((c for c in rollout if not c.is_core),
                       key=lambda c: (moving(c), view.load(c.cell_id), c.cell_id)):
        if fits(cell) and pays(cell):
            leaving.append(cell)
    if not leaving:
        return []
    gone = {c.cell_id for c in leaving}
    staying = [c for c in rollout if c.cell_id not in gone]
    free = free_slots(view, staying)
    keep = needs.running.__contains__ if cut else None
    reason = f"remaining rollout capacity {view.capacity(staying)} serves the next step's {demand} executions"
    return [leave_rollout(view, cell, staying, free, reason, keep=keep) for cell in leaving]


ELASTIC_V1 = Policy(name="elastic", version="elastic/1", params_type=ElasticParams, decide=decide,
                    initial_roles=all_rollout)
ELASTIC_V2 = Policy(name="elastic", version="elastic/2", params_type=ElasticParams, decide=decide_v2,
                    initial_roles=all_rollout)
ELASTIC_V3 = Policy(name="elastic", version="elastic/3", params_type=ElasticV3Params, decide=decide_v3,
                    initial_roles=all_rollout, run_values=elastic3_values)
ELASTIC = ELASTIC_V2
