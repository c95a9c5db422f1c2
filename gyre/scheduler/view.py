"""What a policy sees: the cluster and trainer projections plus a small work projection of our own.

``ClusterView`` knows where each execution *started*; after its calls are redirected it runs elsewhere, so
``WorkView`` tracks each running execution's current cell (its slot), which step each queued batch feeds,
and which GSPO groups are complete (every member scored, excluded or failed), so policies can tell whether
training has work. Everything is a fold of log events: replay rebuilds exactly what the simulator saw.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

from gyre.events.models import Event
from gyre.state import Cell, ClusterState, ClusterView, TrainerState, TrainerView
from gyre.state.fold import Projection, on


@dataclass
class StepWork:
    """The batch of one step: its executions, groups still incomplete and groups done (in order)."""

    executions: int = 0
    group_sizes: dict[str, int] = field(default_factory=dict)
    """Group -> executions not yet done (scored, excluded or failed)."""
    complete_groups: list[str] = field(default_factory=list)
    """Groups whose every member is done, in completion order: micro-steps are cut from this list."""


@dataclass
class Mean:
    total: float = 0.0
    count: int = 0

    def add(self, value: float) -> None:
        self.total += value
        self.count += 1


@dataclass
class WorkState:
    placement: dict[str, str] = field(default_factory=dict)
    """Running execution -> the cell whose slot it holds now (follows redirects)."""
    load: dict[str, int] = field(default_factory=dict)
    """Cell -> running executions placed on it."""
    call_execution: dict[str, str] = field(default_factory=dict)
    """In-flight call -> its execution (a redirect names both)."""
    execution_inflight: dict[str, set[str]] = field(default_factory=dict)
    execution_group: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Execution not yet done -> (step, group)."""
    steps: dict[int, StepWork] = field(default_factory=dict)
    trained: set[int] = field(default_factory=set)
    """Steps whose train step finished."""
    durations: dict[str, Mean] = field(default_factory=dict)
    """Measured means, for policies that weigh a switch against what it buys: ``execution`` (finished
    executions that did not crash), ``micro_step``, ``to_training``/``to_rollout`` (role switches) and
    ``join`` (satellite weight pulls)."""
    planned_micro_steps: int = 0
    """Micro-steps planned by the most recent train step."""

    def mean(self, what: str) -> float | None:
        """Measured mean duration of ``what`` in seconds, or None before the first one."""
        m = self.durations.get(what)
        return m.total / m.count if m is not None and m.count else None

    @property
    def training_pending(self) -> bool:
        """Some queued batch has not been trained yet: training will have work."""
        return len(self.steps) > len(self.trained)


class WorkView(Projection[WorkState]):
    name = "work"
    version = 2
    state_type = WorkState

    @on("execution_queued", "execution_id", "group_id", "step")
    def _queued(self, s: WorkState, execution_id, group_id, step) -> None:
        if execution_id in s.execution_group:  # a new attempt of an unfinished execution: same batch slot
            self._place(s, execution_id, None)
            for call in s.execution_inflight.pop(execution_id, ()):
                del s.call_execution[call]
            return
        step = -1 if step is None else step
        work = s.steps.setdefault(step, StepWork())
        work.executions += 1
        work.group_sizes[group_id] = work.group_sizes.get(group_id, 0) + 1
        s.execution_group[execution_id] = (step, group_id)

    @on("execution_started", "execution_id", "cell_id")
    def _started(self, s: WorkState, execution_id, cell_id) -> None:
        self._place(s, execution_id, cell_id)

    @on("model_call_started", "execution_id", "call_id", "cell_id")
    def _call(self, s: WorkState, execution_id, call_id, cell_id) -> None:
        if execution_id in s.placement:
            s.call_execution[call_id] = execution_id
            s.execution_inflight.setdefault(execution_id, set()).add(call_id)
            self._place(s, execution_id, cell_id)

    @on("model_call_finished", "call_id")
    def _call_finished(self, s: WorkState, call_id) -> None:
        execution_id = s.call_execution.pop(call_id, None)
        if execution_id is not None:
            calls = s.execution_inflight[execution_id]
            calls.discard(call_id)
            if not calls:
                del s.execution_inflight[execution_id]

    @on("call_redirected", "execution_id", "to_cell_id")
    def _redirected(self, s: WorkState, execution_id, to_cell_id) -> None:
        if execution_id in s.placement:
            self._place(s, execution_id, to_cell_id)

    @on("execution_finished", "execution_id", "status", "duration_s")
    def _finished(self, s: WorkState, execution_id, status, duration_s) -> None:
        if status != "harness_error":
            self._measure(s, "execution", duration_s)
        self._place(s, execution_id, None)
        for call in s.execution_inflight.pop(execution_id, ()):  # abandoned with the harness
            del s.call_execution[call]
        if status == "harness_error":  # never evaluated: done for data purposes now
            self._done(s, execution_id)

    @on("reward_recorded", "execution_id")
    def _reward(self, s: WorkState, execution_id) -> None:
        self._done(s, execution_id)

    @on("evaluation_failed", "execution_id")
    def _evaluation_failed(self, s: WorkState, execution_id) -> None:
        self._done(s, execution_id)

    @on("train_step_started", "planned_micro_steps")
    def _step_started(self, s: WorkState, planned_micro_steps) -> None:
        s.planned_micro_steps = planned_micro_steps

    @on("micro_step_finished", "duration_s")
    def _micro_finished(self, s: WorkState, duration_s) -> None:
        self._measure(s, "micro_step", duration_s)

    @on("role_switch_completed", "to_role", "duration_s")
    def _switched(self, s: WorkState, to_role, duration_s) -> None:
        self._measure(s, f"to_{to_role}", duration_s)

    @on("satellite_joined", "transfer_s")
    def _joined(self, s: WorkState, transfer_s) -> None:
        self._measure(s, "join", transfer_s)

    @staticmethod
    def _measure(s: WorkState, what: str, seconds: float | None) -> None:
        if seconds is not None:
            s.durations.setdefault(what, Mean()).add(seconds)

    @on("train_step_finished", "step")
    def _trained(self, s: WorkState, step) -> None:
        if step in s.steps:
            s.trained.add(step)

    @staticmethod
    def _place(s: WorkState, execution_id: str, cell_id: str | None) -> None:
        old = s.placement.pop(execution_id, None)
        if old is not None:
            s.load[old] -= 1
        if cell_id is not None:
            s.placement[execution_id] = cell_id
            s.load[cell_id] = s.load.get(cell_id, 0) + 1

    @staticmethod
    def _done(s: WorkState, execution_id: str) -> None:
        located = s.execution_group.pop(execution_id, None)
        if located is None:
            return
        step, group = located
        work = s.steps[step]
        work.group_sizes[group] -= 1
        if work.group_sizes[group] == 0:
            del work.group_sizes[group]
            work.complete_groups.append(group)


@dataclass(frozen=True)
class SchedulerView:
    """Read-only facade over the three states a policy reads. Cheap to build: it copies nothing."""

    cluster: ClusterState
    trainer: TrainerState
    work: WorkState

    @property
    def watermark(self) -> int:
        """Running plus queued executions: the rollout demand."""
        return self.cluster.watermark

    def cells_in(self, role: str) -> list[Cell]:
        """Live cells settled in ``role`` (not leaving it), by id."""
        return sorted(self.cluster.cells_in(role), key=lambda c: c.cell_id)

    def entering(self, role: str) -> list[Cell]:
        """Live cells switching into ``role``, by id."""
        return sorted((c for c in self.cluster.cells.values()
                       if not c.lost and c.switching_to == role and c.role != role), key=lambda c: c.cell_id)

    def capacity(self, cells: Iterable[Cell]) -> int:
        return sum(c.slots for c in cells)

    def load(self, cell_id: str) -> int:
        """Executions holding a slot on the cell."""
        return self.work.load.get(cell_id, 0)

    @property
    def core(self) -> Cell | None:
        for cell in self.cluster.cells.values():
            if cell.is_core and not cell.lost:
                return cell
        return None

    @property
    def open_step(self) -> int | None:
        """The train step in progress (started, not finished): its owner, the core, must stay."""
        current = self.trainer.current
        return None if current is None or current.closed else current.step

    def busy_training(self) -> set[str]:
        """Cells running a claimed, unfinished micro-step."""
        current = self.trainer.current
        if current is None or current.closed:
            return set()
        return {cell for m, cell in current.claimed.items() if m not in current.finished}

    @property
    def training_pending(self) -> bool:
        return self.work.training_pending


class SchedulerFold:
    """The projections behind a ``SchedulerView``, folded one event at a time (simulator, replay, live)."""

    def __init__(self) -> None:
        self.projections: tuple[Projection, ...] = (ClusterView(), TrainerView(), WorkView())
        self.states = [p.initial() for p in self.projections]
        self.view = SchedulerView(*self.states)

    def apply(self, event: Event) -> None:
        for projection, state in zip(self.projections, self.states, strict=True):
            projection.apply(state, event)
