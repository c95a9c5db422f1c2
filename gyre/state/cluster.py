"""The cluster view: cells, their roles and slots, executions waiting or running, calls in flight.

This is what scheduling policies read. The rollout watermark is ``running + queued`` executions.

Its membership rules (a cell registered, switching, lost, replaced) are `CellsView`'s, which the cluster
view extends: a cluster run's actuators read that smaller view, folded as events are recorded
(`gyre.run.live`), so both see one rule.
"""

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gyre.state.fold import Projection, on


@dataclass(slots=True)
class Cell:
    cell_id: str
    role: str
    is_core: bool = False
    slots: int = 0
    gpus: int = 0
    switching_to: str | None = None
    """Target role of a requested switch that has not completed yet."""
    lost: bool = False
    incarnation: str | None = None
    """The registered process (cluster runs): a late fact about an earlier one does not apply to it."""
    address: str | None = None
    """Its engine's URL (cluster runs)."""
    trainer_endpoint: str | None = None

    def settled_in(self, role: str) -> bool:
        """Live, in ``role`` and not leaving it (in rollout: the proxy may place executions here)."""
        return not self.lost and self.role == role and self.switching_to in (None, role)


@dataclass(slots=True)
class CellsState:
    cells: dict[str, Cell] = field(default_factory=dict)
    now_us: int = 0

    @property
    def core(self) -> Cell | None:
        return next((c for c in self.cells.values() if c.is_core), None)


@dataclass(slots=True)
class ClusterState:
    cells: dict[str, Cell] = field(default_factory=dict)
    queued: set[str] = field(default_factory=set)
    running: dict[str, str | None] = field(default_factory=dict)
    """Running execution -> the cell it started on (None when not pinned to a cell)."""
    call_cell: dict[str, str] = field(default_factory=dict)
    """In-flight call -> the cell serving it now."""
    execution_calls: dict[str, set[str]] = field(default_factory=dict)
    """Running execution -> its calls in flight."""
    now_us: int = 0
    """``ts`` of the last event folded in: the view's notion of time."""

    @property
    def watermark(self) -> int:
        return len(self.queued) + len(self.running)

    def cells_in(self, role: str) -> list[Cell]:
        """Live cells whose current role is ``role`` and that are not leaving it."""
        return [c for c in self.cells.values() if c.settled_in(role)]

    @property
    def rollout_capacity(self) -> int:
        return sum(c.slots for c in self.cells_in("rollout"))

    def inflight(self, cell_id: str) -> list[str]:
        """Calls in flight on a cell, in a stable order."""
        return sorted(call for call, cell in self.call_cell.items() if cell == cell_id)


class CellsView(Projection[CellsState]):
    """Membership: each cell's role, the switch under way, its incarnation and addresses, lost or not."""

    name = "cells"
    state_type = CellsState

    @on("cell_registered", "cell_id", "role", "is_core", "slots", "gpus", "incarnation", "address",
        "trainer_endpoint", "ts")
    def _registered(self, s: CellsState, cell_id, role, is_core, slots, gpus, incarnation, address,
                    trainer_endpoint, ts) -> None:
        s.cells[cell_id] = Cell(cell_id, role, is_core, slots, gpus, incarnation=incarnation, address=address,
                                trainer_endpoint=trainer_endpoint)
        s.now_us = ts

    @on("cell_lost", "cell_id", "ts")
    def _lost(self, s: CellsState, cell_id, ts) -> None:
        cell = s.cells.get(cell_id)
        if cell is not None:
            cell.lost, cell.switching_to = True, None
        s.now_us = ts

    @on("role_switch_requested", "cell_id", "to_role", "ts")
    def _switch_requested(self, s: CellsState, cell_id, to_role, ts) -> None:
        cell = s.cells.get(cell_id)
        if cell is not None:
            cell.switching_to = to_role
        s.now_us = ts

    @on("role_switch_completed", "cell_id", "to_role", "ts")
    def _switch_completed(self, s: CellsState, cell_id, to_role, ts) -> None:
        cell = s.cells.get(cell_id)
        if cell is not None:
            cell.role, cell.switching_to = to_role, None
        s.now_us = ts

    @on("command_abandoned", "cell_id", "switch_to", "incarnation", "ts")
    def _abandoned(self, s: CellsState, cell_id, switch_to, incarnation, ts) -> None:
        """A switch given up on ends: the cell stays in its role, and the policy may decide for it again (not
        a switch of a later incarnation, decided after the one the command was for was replaced)."""
        cell = s.cells.get(cell_id) if cell_id is not None else None
        if (cell is not None and switch_to is not None and cell.switching_to == switch_to
                and (incarnation is None or cell.incarnation in (None, incarnation))):
            cell.switching_to = None
        s.now_us = ts

SKIP_PAIRS_FROM_ROWS = 1024
"""Finding the call pairs to skip costs a join and two group-bys (~1.5 ms however small the batch): worth it
for a replay's large batches, a loss for the controller's live ones (a few calls each)."""


class ClusterView(CellsView):
    name = "cluster"
    version = 3  # cells carry their incarnation and addresses; command_abandoned ends a switch
    state_type = ClusterState  # type: ignore[assignment]  # a CellsState too: cells and now_us

    def apply_batch(self, state: ClusterState, batch: pa.RecordBatch,
                    rows: pa.Array | None = None) -> ClusterState:
        """The batch driver, minus the calls that start and finish within the batch.

        Such a call leaves this view as it found it, whatever came between its two events (a redirect,
        its execution finishing), so both rows are skipped: most calls of a replayed log are such pairs,
        and skipping them halves the Python work of a replay. Only ``now_us`` needs setting afterwards.
        """
        if rows is not None or batch.num_rows < SKIP_PAIRS_FROM_ROWS:
            return super().apply_batch(state, batch, rows)
        keep = _calls_not_done_within(batch, state)
        if keep is None:
            return super().apply_batch(state, batch)
        super().apply_batch(state, batch, keep)
        relevant = np.flatnonzero(pc.is_in(batch.column("kind"), value_set=self.kind_values).to_numpy(False))
        state.now_us = batch.column("ts")[int(relevant[-1])].value
        return state

    @on("execution_queued", "execution_id", "ts")
    def _queued(self, s: ClusterState, execution_id, ts) -> None:
        s.queued.add(execution_id)
        # Queued again (a new attempt after a crash): the old attempt's harness and calls are gone.
        s.running.pop(execution_id, None)
        for call in s.execution_calls.pop(execution_id, ()):
            s.call_cell.pop(call, None)
        s.now_us = ts

    @on("execution_started", "execution_id", "cell_id", "ts")
    def _started(self, s: ClusterState, execution_id, cell_id, ts) -> None:
        s.queued.discard(execution_id)
        s.running[execution_id] = cell_id
        s.now_us = ts

    @on("execution_finished", "execution_id", "ts")
    def _finished(self, s: ClusterState, execution_id, ts) -> None:
        s.queued.discard(execution_id)
        s.running.pop(execution_id, None)
        # The harness is gone: whatever it had in flight is abandoned.
        for call in s.execution_calls.pop(execution_id, ()):
            s.call_cell.pop(call, None)
        s.now_us = ts

    @on("model_call_started", "call_id", "execution_id", "cell_id", "ts")
    def _call_started(self, s: ClusterState, call_id, execution_id, cell_id, ts) -> None:
        s.call_cell[call_id] = cell_id
        calls = s.execution_calls.get(execution_id)
        if calls is None:
            s.execution_calls[execution_id] = {call_id}
        else:
            calls.add(call_id)
        s.now_us = ts

    @on("model_call_finished", "call_id", "execution_id", "ts")
    def _call_finished(self, s: ClusterState, call_id, execution_id, ts) -> None:
        if s.call_cell.pop(call_id, None) is not None:
            calls = s.execution_calls.get(execution_id)
            if calls is not None:
                calls.discard(call_id)
                if not calls:
                    del s.execution_calls[execution_id]
        s.now_us = ts

    @on("call_redirected", "call_id", "to_cell_id", "ts")
    def _redirected(self, s: ClusterState, call_id, to_cell_id, ts) -> None:
        if call_id in s.call_cell:
            s.call_cell[call_id] = to_cell_id
        s.now_us = ts


def _calls_not_done_within(batch: pa.RecordBatch, state: ClusterState) -> pa.Array | None:
    """Mask of the rows to fold: all but the start and finish of each call that begins and ends within
    ``batch``, once each, start first, under one execution, and that the state does not know yet (a second
    start of an in-flight call overwrites it, and its finish would then end the earlier one; a call left in
    an execution's set, by a finish under another execution, would be removed by the pair). None: nothing
    to skip."""
    kind = batch.column("kind")
    started, finished = pc.equal(kind, "model_call_started"), pc.equal(kind, "model_call_finished")
    if not (pc.any(started).as_py() and pc.any(finished).as_py()):
        return None
    rows = pa.table({"call": batch.column("call_id"), "execution": batch.column("execution_id"),
                     "row": pa.array(np.arange(batch.num_rows))})
    aggregates = [("row", "min"), ("row", "count"), ("execution", "min")]  # min of one row: the row's
    starts = rows.filter(started).group_by("call").aggregate(aggregates)
    finishes = rows.filter(finished).group_by("call").aggregate(aggregates)
    pairs = starts.join(finishes, "call", join_type="inner", right_suffix="_finish")
    once_each = pc.and_(pc.equal(pairs["row_count"], 1), pc.equal(pairs["row_count_finish"], 1))
    start_first = pc.less(pairs["row_min"], pairs["row_min_finish"])
    one_execution = pc.equal(pairs["execution_min"], pairs["execution_min_finish"])
    known = set(state.call_cell).union(*state.execution_calls.values())
    new_call = pc.invert(pc.is_in(pairs["call"], value_set=pa.array(list(known), pa.string())))
    done = pc.fill_null(pc.and_(pc.and_(once_each, start_first), pc.and_(one_execution, new_call)), False)
    pairs = pairs.filter(done)
    if not pairs.num_rows:
        return None
    keep = np.ones(batch.num_rows, dtype=bool)
    keep[pairs["row_min"].to_numpy()] = False
    keep[pairs["row_min_finish"].to_numpy()] = False
    return pa.array(keep)
