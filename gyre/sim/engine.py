"""The discrete-event simulation: drives a policy over a workload and writes the events a real run would.

Each simulated instant runs in one round: the actions due now (calls, finishes, evaluations, switches,
micro-steps), then the shared mechanics (admit batches, dispatch, start steps, claim micro-steps), then the
policy decides once on the view folded from every event so far, and its decisions take effect (redirects,
and with partial rollouts the cuts of what a leaving cell does not redirect, are emitted in the same
instant). Replay relies on this shape: in a log, a policy's decisions are the
``role_switch_requested`` events of an instant, decided on the events of that instant that precede them.
"""

from collections.abc import Callable
from datetime import datetime

from gyre.errors import GyreError
from gyre.events.models import (
    CellRegistered,
    Event,
    RoleSwitchCompleted,
    RoleSwitchRequested,
    RunFinished,
    RunStarted,
)
from gyre.scheduler import Policy, PolicyParams, SchedulerFold
from gyre.scheduler.policy import CellSpec
from gyre.sim.breakdown import CellTime
from gyre.sim.clock import Agenda, timestamp, to_us
from gyre.sim.rollouts import Rollouts
from gyre.sim.scenario import Scenario
from gyre.sim.stats import Stats
from gyre.sim.training import Trainer
from gyre.sim.workload import Workload
from gyre.sink import EventSink


class SimulationError(GyreError):
    """The simulated run cannot go on: a policy broke an invariant, or nothing can make progress."""


class Simulation:
    def __init__(self, scenario: Scenario, workload: Workload, policy: Policy, params: PolicyParams,
                 sink: EventSink, *, seed: int, run_id: str, cell_time: CellTime | None = None) -> None:
        self.scenario, self.workload, self.policy, self.params = scenario, workload, policy, params
        self.sink, self.seed, self.run_id = sink, seed, run_id
        self.agenda = Agenda()
        self.fold = SchedulerFold()
        self.view = self.fold.view
        self.now = 0
        self.ts: datetime = timestamp(0)
        self.cells = [CellSpec(f"cell-{i}", i == 0, scenario.cluster.slots_per_cell)
                      for i in range(scenario.cluster.cells)]
        self.core_id = self.cells[0].cell_id
        self.stats = Stats([c.cell_id for c in self.cells], {c.cell_id: c.slots for c in self.cells})
        self.rollouts = Rollouts(self)
        self.trainer = Trainer(self)
        self._buffer: list[Event] = []
        self.cell_time = cell_time
        """Optional, read-only: where the cell-time goes, observed after each round."""

    # -- plumbing ----------------------------------------------------------------------------------------

    def emit(self, event: Event) -> None:
        self.fold.apply(event)
        self._buffer.append(event)
        if len(self._buffer) >= 8192:
            self.sink.record(self._buffer)
            self._buffer = []

    def after(self, delay_s: float, action: Callable[[], None]) -> None:
        """Schedule strictly after now, so every instant has exactly one decision round."""
        self.agenda.at(self.now + max(1, to_us(delay_s)), action)

    # -- the run -----------------------------------------------------------------------------------------

    def run(self) -> int:
        """Simulate to the last published step; return the makespan in microseconds."""
        self._register()
        self._round()
        while not self.trainer.done:
            due = self.agenda.next_due()
            if due is None:
                raise SimulationError(
                    f"policy {self.policy.name!r} stalled the run at step {self.trainer.next_train} of "
                    f"{self.workload.steps}: nothing is scheduled (no cell can roll out or train)")
            self.now, self.ts = due, timestamp(due)
            while (action := self.agenda.pop_due(due)) is not None:
                action()
            self._round()
        self.emit(RunFinished(ts=self.ts, run_id=self.run_id, status="completed"))
        self.sink.record(self._buffer)
        self._buffer = []
        return self.now

    def _register(self) -> None:
        sc = self.scenario
        self.emit(RunStarted(ts=self.ts, run_id=self.run_id, name=f"sim {sc.name} {self.policy.name}",
                             policy=self.policy.name, policy_version=self.policy.version,
                             policy_params=self.params.model_dump_json(),
                             config=sc.model_dump_json(by_alias=True), seed=self.seed, gyre_version="sim"))
        roles = self.policy.initial_roles(self.cells, self.params)
        for cell in self.cells:
            self.emit(CellRegistered(ts=self.ts, cell_id=cell.cell_id, role=roles[cell.cell_id], is_core=cell.is_core,
                                     slots=cell.slots, gpus=sc.cluster.gpus_per_cell))
        for cell in self.cells:
            if roles[cell.cell_id] == "training":
                self.trainer.join_now(cell.cell_id)

    def _round(self) -> None:
        self.trainer.admit()
        self.rollouts.dispatch()
        self.trainer.start_and_claim()
        for decision in self.policy.decide(self.view, self.params):
            self._check(decision)
            self.emit(decision.model_copy(update={"ts": self.ts}))
            self._switch(decision)
        if self.cell_time is not None:
            self.cell_time.observe(self)

    # -- decisions ---------------------------------------------------------------------------------------

    def _check(self, d: RoleSwitchRequested) -> None:
        cell = self.view.cluster.cells.get(d.cell_id)
        problem = None
        if cell is None or cell.lost:
            problem = "no such live cell"
        elif cell.switching_to is not None:
            problem = f"it is already switching to {cell.switching_to}"
        elif cell.role != d.from_role or d.to_role == d.from_role:
            problem = f"it is in role {cell.role}, the decision says {d.from_role} -> {d.to_role}"
        elif d.to_role == "training":
            moved = {r.call_id for r in d.redirects}
            left = set(self.view.cluster.inflight(d.cell_id)) - moved
            if left and not self.params.partial_rollouts:
                problem = f"calls {sorted(left)[:3]} stay on the cell without a redirect"
            for r in d.redirects:
                target = self.view.cluster.cells.get(r.to_cell_id)
                if target is None or target.role != "rollout" or target.switching_to is not None:
                    problem = f"call {r.call_id} is redirected to {r.to_cell_id}, which is not serving rollouts"
        if problem:
            raise SimulationError(f"policy {self.policy.name!r} asked to switch {d.cell_id} "
                                  f"{d.from_role} -> {d.to_role}: {problem}")

    def _switch(self, d: RoleSwitchRequested) -> None:
        cell, requested = d.cell_id, self.now
        self.stats.switches += 1
        sw = self.scenario.switch
        if d.to_role == "training":
            self.rollouts.redirect_all(d.redirects, cell)
            if self.params.partial_rollouts:
                self.rollouts.cut(cell)  # what was not redirected is cut, to continue later
            for execution in self.rollouts.on_cell(cell):
                raise SimulationError(f"execution {execution} still holds a slot on {cell}, which left rollout")
            self.after(sw.to_training_s, lambda: self._switched(d, requested))
        else:
            self.trainer.release(cell, lambda: self.after(sw.to_rollout_s, lambda: self._switched(d, requested)))

    def _switched(self, d: RoleSwitchRequested, requested_us: int) -> None:
        self.emit(RoleSwitchCompleted(ts=self.ts, cell_id=d.cell_id, from_role=d.from_role, to_role=d.to_role,
                                      duration_s=(self.now - requested_us) / 1e6))
        for slot_owner, slots in self.view.work.load.items():
            cell = self.view.cluster.cells[slot_owner]
            if slots > cell.slots:
                raise SimulationError(f"{slot_owner} holds {slots} executions but has {cell.slots} slots")
        if d.to_role == "training":
            self.trainer.arrive(d.cell_id)
