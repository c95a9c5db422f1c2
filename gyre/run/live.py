"""The run's state as its actuators read it: membership and weights, folded as each event is recorded.

The controller folds the log on its own thread, a little behind. An actuator that has just recorded that
its cell loaded a version, or the membership thread that has just registered a cell, must read the state
that includes it: so `LiveRun` folds `CellsView` and `RunView` at record time (the sink calls it in seq
order, under its lock; a producer's Arrow batch is folded from its columns) and on a resumed run's
catch-up, and anyone may read it, from any thread, under its condition. It is the one place the cluster's
control plane learns a cell's role, incarnation and addresses, the version its engine serves and the
latest published weights: no second copy is kept beside the log.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from gyre.events.models import Event
from gyre.state import BatchColumns
from gyre.state.cluster import Cell, CellsState, CellsView
from gyre.state.run import RunState, RunView, Weights

T = TypeVar("T")


class LiveRun:
    """`CellsView` + `RunView`, folded event by event; reads and waits are thread-safe."""

    def __init__(self) -> None:
        self._cells_view, self._run_view = CellsView(), RunView()
        self.cells: CellsState = self._cells_view.initial()
        self.run: RunState = self._run_view.initial()
        self._cond = threading.Condition()
        self._watchers: list[Callable[[], None]] = []
        self._core_id = ""
        self._weights_key = self._weights()

    def watch_weights(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (on the recording thread, quick, never recording) after each fold that changed the
        latest weights the log names or the core's incarnation or loss: what a weights ask's answer reads."""
        self._watchers.append(callback)

    def _weights(self) -> tuple[object, ...]:
        core = self.cells.cells.get(self._core_id)  # `CellsState.core` scans every cell: once per fold is too many
        if core is None or not core.is_core:
            core = self.cells.core
            self._core_id = core.cell_id if core is not None else ""
        return self.run.latest, core and (core.cell_id, core.incarnation, core.lost)

    def _folded(self) -> None:
        """(Under the lock, after a fold.) Wake the waiters; tell the watchers if the weights changed."""
        self._cond.notify_all()
        if self._watchers:
            key = self._weights()
            if key != self._weights_key:
                self._weights_key = key
                for callback in self._watchers:
                    callback()

    @property
    def kinds(self) -> frozenset[str]:
        """The kinds that change it (its observer needs no other event decoded)."""
        return self._cells_view.kinds | self._run_view.kinds

    def apply(self, seq: int, event: Event) -> None:
        """Fold one event (the controller's record-time observer): quick, never records anything."""
        with self._cond:
            self._cells_view.apply(self.cells, event)
            self._run_view.apply(self.run, event)
            self._folded()

    def apply_columns(self, first_seq: int, columns: BatchColumns) -> None:
        """Fold an Arrow batch as it was recorded, from its columns: the same state as ``apply`` of each of its
        events (the projections' contract), without turning a row into an event object."""
        with self._cond:
            self._cells_view.apply_columns(self.cells, columns)
            self._run_view.apply_columns(self.run, columns)
            self._folded()

    def read(self, what: Callable[[LiveRun], T]) -> T:
        """``what(self)`` under the lock: a consistent read of both states."""
        with self._cond:
            return what(self)

    def wait_for(self, predicate: Callable[[LiveRun], bool], timeout_s: float | None = None) -> bool:
        """Block until ``predicate(self)`` holds (an event recorded elsewhere makes it so); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout_s)

    # -- what actuators ask ---------------------------------------------------------------------------------

    def cell(self, cell_id: str) -> Cell | None:
        with self._cond:
            cell = self.cells.cells.get(cell_id)
            return None if cell is None else _copy(cell)

    def core(self) -> Cell | None:
        with self._cond:
            core = self.cells.core
            return None if core is None else _copy(core)

    def engine_version(self, cell_id: str) -> int | None:
        """The version the cell's engine serves as the log says (None: not known since it registered)."""
        with self._cond:
            return self.run.engine_versions.get(cell_id)

    def latest(self) -> Weights | None:
        with self._cond:
            return self.run.latest

    def routes(self) -> list[tuple[Cell, int]]:
        """Every registered cell with the version its engine serves (-1: unknown), by id."""
        with self._cond:
            return [(_copy(c), self.run.engine_versions.get(c.cell_id, -1))
                    for c in sorted(self.cells.cells.values(), key=lambda c: c.cell_id)]


def _copy(cell: Cell) -> Cell:
    return Cell(cell.cell_id, cell.role, cell.is_core, cell.slots, cell.gpus, cell.switching_to, cell.lost,
                cell.incarnation, cell.address, cell.trainer_endpoint)


__all__ = ["LiveRun"]
