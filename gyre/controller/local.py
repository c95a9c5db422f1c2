"""The in-process cell: one engine, one trainer replica (the core's) and the gate of the harness runner.

Commands run one at a time, in the order given, on the cell's own thread (a train step then the switch
back to rollout never overlap: the switch loads the weights the step published). Every completion is an
event recorded through the cell's producer; nothing is returned to the controller.

Leaving rollout: close the gate (no execution starts here any more), redirect the in-flight calls the
decision names, drain (wait until no execution runs here), pause the engine, let the trainer take over.
Returning: load the latest published weights into the engine from their file (checksum checked first),
resume the engine, open the gate. Each part is timed and recorded in `role_switch_completed`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from gyre.controller.actuator import OrderedActions, perform_switch
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
        self.weights, self.sink, self.fail, self.redirect = weights, sink, fail, redirect
        self.engine_version = engine_version
        self._actions = OrderedActions(cell_id, fail)

    # -- the actuator interface -----------------------------------------------------------------------------

    def switch(self, decision: RoleSwitchRequested) -> None:
        self._actions.put(lambda: self._switch(decision))

    def train(self, step: int, groups: tuple[str, ...]) -> None:
        self._actions.put(lambda: self.trainer.train_step(step, groups))

    def close(self) -> None:
        """Finish the command under way, drop the rest, stop the thread."""
        self._actions.close()

    # -- role switches --------------------------------------------------------------------------------------

    def _switch(self, decision: RoleSwitchRequested) -> None:
        perform_switch(self.cell_id, decision, self.sink, self._leave_rollout, self._return_to_rollout)

    def _leave_rollout(self, decision: RoleSwitchRequested) -> dict:
        parts: dict = {}
        self.admission.close()
        redirected = 0
        if decision.redirects:
            if self.redirect is None:
                raise RuntimeError(f"cell {self.cell_id} was told to redirect {len(decision.redirects)} calls "
                                   "but has no proxy to redirect through")
            t = time.perf_counter()
            targets = sorted({r.to_cell_id for r in decision.redirects})
            redirected = len(self.redirect(self.cell_id, targets))
            parts["redirect_s"] = time.perf_counter() - t
        parts["redirected_calls"] = redirected
        t = time.perf_counter()
        self.admission.wait_idle()
        parts["drain_s"] = time.perf_counter() - t
        t = time.perf_counter()
        self.engine.pause("abort")
        parts["engine_pause_s"] = time.perf_counter() - t
        t = time.perf_counter()
        self.trainer.join()
        parts["trainer_join_s"] = time.perf_counter() - t
        return parts

    def serve_after_run(self) -> None:
        """After the run's last step, when the controller no longer decides: load the last published weights
        and serve them (the final held-out evaluation). Not a role switch: no event claims one."""
        self._return_to_rollout()

    def _return_to_rollout(self) -> dict:
        parts: dict = {"weights_bytes": 0, "weights_s": 0.0}
        published = self.trainer.published()
        if published is not None and published.version != self.engine_version:
            t = time.perf_counter()
            path = self.weights.verify(published.location, published.sha256)
            response = self.engine.update_weights_from_disk(str(path), version=str(published.version))
            if not getattr(response, "success", True):
                raise RuntimeError(f"engine of cell {self.cell_id} refused weights v{published.version}: "
                                   f"{getattr(response, 'message', '')}")
            parts["weights_bytes"] = path.stat().st_size
            parts["weights_s"] = time.perf_counter() - t
            self.engine_version = published.version
        t = time.perf_counter()
        self.engine.resume()
        parts["engine_resume_s"] = time.perf_counter() - t
        self.admission.open()
        return parts
