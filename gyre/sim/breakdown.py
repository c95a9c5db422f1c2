"""Where a simulated run's cell-time goes: each cell's state between two decision rounds, summed over the run.

This is what says which mechanism still has room (``docs/simulator.md``, *Where the rest of the time
goes*): a schedule can only gain the cell-time it wastes, and only the part of that waste some decision
could have used (a cell idle in training while executions wait for a slot, say), not the part with no
admissible work anywhere. Read-only: the engine calls ``observe`` after each round's decisions, so a run
with it is the run without it (tested).

Categories, as shares of ``cells x makespan`` (they sum to 1):
- ``rollout_held``: slots holding an execution (running, waiting on tools, re-prefilling or migrating in);
- ``rollout_free_queued`` / ``rollout_free_idle``: free slots of rollout cells while executions are queued
  (a dispatch gap) or while none is (no admissible work: the staleness bound, the over-sampling cap);
- ``training_busy``: a micro-step or the core's optimizer step;
- ``training_waiting_queued`` / ``training_waiting_idle``: a joined training cell with nothing to claim in an
  open step whose micro-steps are not all claimed (it waits for groups to complete), with executions queued
  for a rollout slot (a recall could have served them) or none;
- ``training_step_tail``: nothing left to claim in the open step (its last micro-steps, the optimizer);
- ``training_no_step``: joined, no step open (the next step's data is not there yet);
- ``joining``: a satellite in training pulling the weights; ``switching``: a cell changing role (a training
  cell released to rollout counts as busy until its micro-step is done, as ``Stats`` counts it).

``rollout_held + training_busy`` is the run's ``utilization`` up to rounding: both count a slot from an
execution's start (or arrival) to its end, cut or redirect.
"""

from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyre.sim.engine import Simulation

CATEGORIES = ("rollout_held", "rollout_free_queued", "rollout_free_idle", "training_busy",
              "training_waiting_queued", "training_waiting_idle", "training_step_tail", "training_no_step",
              "joining", "switching")


class CellTime:
    """Cell-microseconds per category, from the state left by each round until the next one."""

    def __init__(self) -> None:
        self.us: dict[str, float] = defaultdict(float)
        self._since = 0
        self._state: list[tuple[str, float]] = []

    def observe(self, sim: "Simulation") -> None:
        """Credit the state since the previous round, then record the state this round leaves."""
        elapsed = sim.now - self._since
        for category, cells in self._state:
            self.us[category] += cells * elapsed
        self._since, self._state = sim.now, self._snapshot(sim)

    @staticmethod
    def _snapshot(sim: "Simulation") -> list[tuple[str, float]]:
        view, trainer = sim.view, sim.trainer
        queued = bool(view.cluster.queued)
        step = trainer.open
        out: list[tuple[str, float]] = []
        for cell in view.cluster.cells.values():
            if cell.lost:
                continue
            if cell.cell_id in trainer.busy:  # also while it is released: it finishes its micro-step first
                out.append(("training_busy", 1.0))
            elif cell.switching_to is not None:
                out.append(("switching", 1.0))
            elif cell.role == "rollout":
                held = min(1.0, view.load(cell.cell_id) / cell.slots)
                out += [("rollout_held", held), ("rollout_free_queued" if queued else "rollout_free_idle", 1 - held)]
            elif cell.cell_id not in trainer.joined:
                out.append(("joining", 1.0))
            elif step is None:
                out.append(("training_no_step", 1.0))
            elif step.next_micro >= step.planned:
                out.append(("training_step_tail", 1.0))
            else:
                out.append(("training_waiting_queued" if queued else "training_waiting_idle", 1.0))
        return out

    def shares(self) -> dict[str, float]:
        """Each category's share of all cell-time so far (every category present; they sum to 1)."""
        total = sum(self.us.values())
        return {c: round(self.us[c] / total, 4) if total else 0.0 for c in CATEGORIES}
