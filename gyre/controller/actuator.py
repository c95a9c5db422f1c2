"""The actuator contract: the controller hands over decisions and commands; completions come back as events.

A cell actuator performs a role switch or a train step and records the completion event only when the
action has really completed — `role_switch_completed` with the measured parts of its duration (drain or
redirect, engine pause, weight transfer bytes and seconds, engine resume, trainer join), the trainer's
`train_step_finished` and `weights_published` — on the same sink as every other producer. Calls return at
once: the controller learns of a completion by folding its event, exactly as it will when a cell is a
separate process and this interface is the client side of a gRPC stream (commands down, events up).
A failure is reported to the controller's ``fail`` and ends the run.
"""

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

from gyre.events.models import RoleSwitchCompleted, RoleSwitchRequested
from gyre.sink import EventSink

log = logging.getLogger(__name__)


class CellActuator(Protocol):
    """One cell: its engine, its trainer replica and the gate that admits executions to it."""

    def switch(self, decision: RoleSwitchRequested) -> None:
        """Perform a (recorded, durable) role-switch decision; record its completion when done."""
        ...

    def train(self, step: int, groups: tuple[str, ...]) -> None:
        """Train ``step`` on the batch of ``groups`` (this cell is the core); the trainer records the step."""
        ...

    def close(self) -> None: ...


class Rollouts(Protocol):
    """Where a step's executions are queued: registered with the proxy and handed to the harness runner."""

    def queue(self, step: int, policy_version: int) -> None:
        """Queue step ``step``'s executions; `execution_queued` events are recorded before this returns."""
        ...


class OrderedActions:
    """A cell's actions, one at a time in the order given, on the cell's own thread (a train step and the
    switch back to rollout never overlap: the switch loads the weights the step published). The first action
    that fails goes to ``fail`` (the controller ends the run) and stops the thread."""

    def __init__(self, cell_id: str, fail: Callable[[BaseException], None],
                 tolerate: Callable[[BaseException], bool] = lambda error: False) -> None:
        """``tolerate(error)``: an error the run recovers from by other means (a cluster cell that was lost
        is restarted and registered again): logged, and the next action runs."""
        self.cell_id, self.fail, self.tolerate = cell_id, fail, tolerate
        self._closed = False
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"gyre-cell-{cell_id}", daemon=True)
        self._thread.start()

    def put(self, action: Callable[[], None]) -> bool:
        """Queue ``action``; False (and nothing queued) once closed — a lost cell's actuator, replaced."""
        if self._closed:
            log.warning("cell %s: an action reached the actuator after it was closed (the cell was lost)", self.cell_id)
            return False
        self._queue.put(action)
        return True

    def close(self, wait: bool = True) -> None:
        """Finish the action under way, drop the rest, stop the thread (``wait=False``: without waiting for
        the action under way, as for a cell that was lost and replaced)."""
        self._closed = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while (action := self._queue.get()) is not None:
            try:
                action()
            except Exception as error:
                if not self.tolerate(error):
                    log.exception("cell %s: action failed", self.cell_id)
                    self.fail(error)
                    return
                log.warning("cell %s: an action was cut short: %s", self.cell_id, error)
            except BaseException as error:  # reported, never swallowed: the controller ends the run
                log.exception("cell %s: action failed", self.cell_id)
                self.fail(error)
                return


class CellOps(Protocol):
    """The steps of a role switch on one cell. The in-process cell (`gyre.controller.local.LocalCell`) does
    each in this process; a cluster's `gyre.cluster.actuator.RemoteCell` sends the cell's own side of each
    direction as one command. A step returns the seconds it took where it ran (a cell process measures its
    own part), or None to have it timed here."""

    def stop_admitting(self) -> None:
        """No new execution is placed on the cell."""
        ...

    def redirect(self, decision: RoleSwitchRequested) -> tuple[int, float | None]:
        """Move the calls in flight the decision names to the cells it names; returns how many moved."""
        ...

    def drain(self) -> float | None:
        """Wait until no execution the cell still holds runs on it."""
        ...

    def to_training(self) -> dict:
        """Pause the engine (calls in flight end now), release its memory (KV cache; weights on a GPU) and let
        the trainer take the cell over (a satellite joins the core's step with the current weights); the
        measured ``engine_pause_s`` (pause and release) and ``trainer_join_s``. A cell process does them as
        one command, the in-process cell one by one (`training_steps`)."""
        ...

    def to_rollout(self, cause: str) -> dict:
        """Leave the trainer (a satellite; the core's replica stays resident), bring the engine to the latest
        published weights (recording `weights_loaded` where the run tracks each engine's version), take its
        memory back and resume generation; the measured ``weights_bytes`` (0: it held them already),
        ``weights_s`` and ``engine_resume_s``. A cell process does the three as one command (at a step's end
        every returning cell's go at once: one round trip each, not three); the in-process cell does them
        one by one (`rollout_steps`)."""
        ...

    def admit(self) -> None:
        """Executions may be placed on the cell again."""
        ...


class TrainingSteps(Protocol):
    """`CellOps.to_training` as separate steps, for a cell that does them in this process."""

    def pause(self) -> float | None:
        """Pause the engine (calls in flight end now) and release its memory (KV cache; weights on a GPU)."""
        ...

    def join_training(self) -> float | None:
        """The trainer takes the cell over (a satellite joins the core's step with the current weights)."""
        ...


class RolloutSteps(Protocol):
    """`CellOps.to_rollout` as separate steps, for a cell that does them in this process."""

    def leave_training(self) -> None:
        """A satellite leaves the trainer (the core's replica stays resident)."""
        ...

    def load_latest(self, cause: str) -> tuple[int, float | None]:
        """The engine serves the latest published weights (0 bytes: it did already); records
        `weights_loaded` where the run tracks each engine's version."""
        ...

    def serve(self) -> float | None:
        """Take the engine's memory back and resume generation."""
        ...


def _timed(step: Callable[[], float | None]) -> float:
    started = time.perf_counter()
    measured = step()
    return measured if measured is not None else time.perf_counter() - started


def leave_rollout(ops: CellOps, decision: RoleSwitchRequested) -> dict:
    """rollout -> training, the same steps in one process and in a cluster; returns the measured parts."""
    ops.stop_admitting()
    started = time.perf_counter()
    calls, redirect_s = ops.redirect(decision)
    parts: dict = {"redirected_calls": calls,
                   "redirect_s": redirect_s if redirect_s is not None else time.perf_counter() - started}
    parts["drain_s"] = _timed(ops.drain)
    return {**parts, **ops.to_training()}


def training_steps(steps: TrainingSteps) -> dict:
    """`CellOps.to_training` step by step, each timed here unless it measured itself."""
    return {"engine_pause_s": _timed(steps.pause), "trainer_join_s": _timed(steps.join_training)}


def rollout_steps(steps: RolloutSteps, cause: str) -> dict:
    """`CellOps.to_rollout` step by step, each timed here unless it measured itself."""
    steps.leave_training()
    started = time.perf_counter()
    weights_bytes, weights_s = steps.load_latest(cause)
    parts: dict = {"weights_bytes": weights_bytes,
                   "weights_s": 0.0 if not weights_bytes else
                   weights_s if weights_s is not None else time.perf_counter() - started}
    parts["engine_resume_s"] = _timed(steps.serve)
    return parts


def return_to_rollout(ops: CellOps) -> dict:
    """training -> rollout, the same steps in one process and in a cluster; returns the measured parts."""
    parts = ops.to_rollout("return_to_rollout")
    ops.admit()
    return parts


def perform_switch(cell_id: str, decision: RoleSwitchRequested, sink: EventSink, ops: CellOps) -> None:
    """Carry out a recorded switch and, only once every part has completed, record `role_switch_completed`
    with the parts' measured seconds and bytes (durable before this returns)."""
    started = time.perf_counter()
    parts = leave_rollout(ops, decision) if decision.to_role == "training" else return_to_rollout(ops)
    done = RoleSwitchCompleted(cell_id=cell_id, from_role=decision.from_role, to_role=decision.to_role,
                               duration_s=time.perf_counter() - started, **parts)
    sink.commit(sink.record(done))
