"""The in-process cell: one engine, one trainer replica (the core's) and the gate of the harness runner.

Commands run one at a time, in the order given, on the cell's own thread (a train step then the switch
back to rollout never overlap: the switch loads the weights the step published). Every completion is an
event recorded through the cell's producer; nothing is returned to the controller.

A role switch runs the steps every cell runs (`gyre.controller.actuator.leave_rollout` and
`return_to_rollout`), each done here: leaving rollout closes the gate (no execution starts here any more),
redirects the in-flight calls the decision names, drains (one cell: its executions have nowhere to go, so
they end first), pauses the engine and releases its memory, and lets the trainer take over. Returning loads
the latest published weights into the engine from their file (checksum checked first), takes the memory
back, resumes the engine and opens the gate. Each part is timed and recorded in `role_switch_completed`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from gyre.controller.actuator import OrderedActions, perform_switch, rollout_steps, training_steps
from gyre.events.models import RoleSwitchRequested
from gyre.sink import EventSink
from gyre.trainer.weights import Published, WeightStore

log = logging.getLogger(__name__)


class CoreTrainer(Protocol):
    """The core's trainer replica as the cell drives it."""

    def join(self) -> None:
        """Make the trainer ready on this cell (weights and optimizer resident)."""
        ...

    def train_step(self, step: int, groups: tuple[str, ...]) -> None:
        """Build the step's batch from the log, train it, publish the new weights (all as events)."""
        ...

    def published(self) -> Published | None:
        """The latest published weights (None before the first step)."""
        ...


class EngineControl(Protocol):
    def pause(self, mode: str = "abort") -> None: ...
    def resume(self) -> None: ...
    def release_memory_occupation(self) -> None: ...
    def resume_memory_occupation(self) -> None: ...
    def update_weights_from_disk(self, path: str, version: str | None = None, *,
                                 abort_all_requests: bool = False) -> object: ...


class Admission(Protocol):
    """The harness runner's side of a cell: admit executions or hold them back, and drain."""

    def open(self) -> None: ...
    def close(self) -> None: ...
    def wait_idle(self) -> None: ...


Redirect = Callable[[str, list[str]], object]


class LocalCell:
    def __init__(self, cell_id: str, *, engine: EngineControl, admission: Admission, trainer: CoreTrainer,
                 weights: WeightStore, sink: EventSink, fail: Callable[[BaseException], None],
                 redirect: Redirect | None = None, engine_version: int = 0) -> None:
        self.cell_id = cell_id
        self.engine, self.admission, self.trainer = engine, admission, trainer
        self.weights, self.sink, self.fail, self.redirect_calls = weights, sink, fail, redirect
        self.engine_version = engine_version
        self._released = False
        self._actions = OrderedActions(cell_id, fail)

    # -- the actuator interface -----------------------------------------------------------------------------

    def switch(self, decision: RoleSwitchRequested) -> None:
        self._actions.put(lambda: self._switch(decision))

    def train(self, step: int, groups: tuple[str, ...]) -> None:
        self._actions.put(lambda: self.trainer.train_step(step, groups))

    def close(self) -> None:
        """Finish the command under way, drop the rest, stop the thread."""
        self._actions.close()

    # -- role switches: the steps of `gyre.controller.actuator.CellOps`, in this process ----------------------

    def _switch(self, decision: RoleSwitchRequested) -> None:
        perform_switch(self.cell_id, decision, self.sink, self)

    def stop_admitting(self) -> None:
        self.admission.close()

    def redirect(self, decision: RoleSwitchRequested) -> tuple[int, float | None]:
        if not decision.redirects:
            return 0, None
        if self.redirect_calls is None:
            raise RuntimeError(f"cell {self.cell_id} was told to redirect {len(decision.redirects)} calls "
                               "but has no proxy to redirect through")
        return len(self.redirect_calls(self.cell_id, sorted({r.to_cell_id for r in decision.redirects}))), None

    def drain(self) -> None:
        self.admission.wait_idle()  # one cell: nowhere to move its executions, so they end here first

    def pause(self) -> None:
        self.engine.pause("abort")
        self.engine.release_memory_occupation()
        self._released = True

    def join_training(self) -> None:
        self.trainer.join()

    def to_training(self) -> dict:
        return training_steps(self)

    def to_rollout(self, cause: str) -> dict:
        return rollout_steps(self, cause)

    def leave_training(self) -> None:
        """The core's replica stays resident: nothing to leave."""

    def load_latest(self, cause: str) -> tuple[int, float | None]:
        published = self.trainer.published()
        if published is None or published.version == self.engine_version:
            return 0, None
        path = self.weights.verify(published.location, published.sha256)
        response = self.engine.update_weights_from_disk(str(path), version=str(published.version))
        if not getattr(response, "success", True):
            raise RuntimeError(f"engine of cell {self.cell_id} refused weights v{published.version}: "
                               f"{getattr(response, 'message', '')}")
        self.engine_version = published.version
        return path.stat().st_size, None

    def serve(self) -> None:
        if self._released:
            self.engine.resume_memory_occupation()
            self._released = False
        self.engine.resume()

    def admit(self) -> None:
        self.admission.open()
