"""Hand-built scheduler views: fold a few events into a ``SchedulerFold``, as the log would."""

import itertools

import pytest

from gyre.events.models import (
    CellRegistered,
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    MicroStepClaimed,
    ModelCallFinished,
    ModelCallStarted,
    RewardRecorded,
    RoleSwitchCompleted,
    RoleSwitchRequested,
    TrainStepFinished,
    TrainStepStarted,
)
from gyre.scheduler import SchedulerFold, SchedulerView


class ClusterBuilder:
    """A toy cluster whose view is folded from real events (cell-0 is the core)."""

    def __init__(self, cells: int = 4, slots: int | list[int] = 8, roles: dict[str, str] | None = None) -> None:
        self.fold = SchedulerFold()
        self._ids = itertools.count()
        sizes = slots if isinstance(slots, list) else [slots] * cells
        for i, size in enumerate(sizes):
            cell = f"cell-{i}"
            role = (roles or {}).get(cell, "rollout")
            self.fold.apply(CellRegistered(cell_id=cell, role=role, is_core=i == 0, slots=size))

    @property
    def view(self) -> SchedulerView:
        return self.fold.view

    def queue(self, n: int, step: int = 0, group_size: int = 4) -> list[str]:
        out = []
        for _ in range(n):
            i = next(self._ids)
            execution = f"e{i:04d}"
            group = f"s{step}-g{i // group_size}"
            self.fold.apply(ExecutionQueued(execution_id=execution, task_id=group, group_id=group, step=step))
            out.append(execution)
        return out

    def start(self, execution: str, cell: str) -> None:
        self.fold.apply(ExecutionStarted(execution_id=execution, cell_id=cell))
        self.fold.apply(ModelCallStarted(execution_id=execution, call_id=f"{execution}-c0", cell_id=cell))

    def run(self, n: int, cells: list[str], step: int = 0) -> list[str]:
        """Queue ``n`` executions and start them round-robin on ``cells``."""
        executions = self.queue(n, step)
        for execution, cell in zip(executions, itertools.cycle(cells)):
            self.start(execution, cell)
        return executions

    def finish(self, execution: str) -> None:
        cell = self.view.work.placement[execution]
        self.fold.apply(ModelCallFinished(execution_id=execution, call_id=f"{execution}-c0", cell_id=cell))
        self.fold.apply(ExecutionFinished(execution_id=execution, status="completed", duration_s=1.0))
        self.fold.apply(RewardRecorded(execution_id=execution, reward=1.0))

    def switch(self, cell: str, to: str, complete: bool = True) -> None:
        current = self.view.cluster.cells[cell].role
        self.fold.apply(RoleSwitchRequested(cell_id=cell, from_role=current, to_role=to))
        if complete:
            self.fold.apply(RoleSwitchCompleted(cell_id=cell, from_role=current, to_role=to, duration_s=1.0))

    def apply(self, events: list) -> None:
        for event in events:
            self.fold.apply(event)
            if isinstance(event, RoleSwitchRequested):
                self.fold.apply(RoleSwitchCompleted(cell_id=event.cell_id, from_role=event.from_role,
                                                    to_role=event.to_role, duration_s=1.0))

    def open_step(self, step: int = 0, claims: dict[int, str] | None = None) -> None:
        self.fold.apply(TrainStepStarted(step=step, policy_version=step, planned_micro_steps=8))
        for m, cell in (claims or {}).items():
            self.fold.apply(MicroStepClaimed(step=step, cell_id=cell, micro_step=m))

    def close_step(self, step: int = 0) -> None:
        self.fold.apply(TrainStepFinished(step=step, policy_version=step + 1, micro_steps=8))


@pytest.fixture
def cluster() -> ClusterBuilder:
    return ClusterBuilder()


@pytest.fixture
def make_cluster() -> type[ClusterBuilder]:
    return ClusterBuilder
