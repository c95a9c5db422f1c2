"""What a policy sees: the cluster and trainer projections plus a small work projection of our own.

``ClusterView`` knows where each execution *started*; after its calls are redirected it runs elsewhere, so
``WorkView`` tracks each running execution's current cell (its slot), which step each queued batch feeds,
and which GSPO groups are complete (every member scored, excluded or failed), so policies can tell whether
training has work. Everything is a fold of log events: replay rebuilds exactly what the simulator saw.
"""

import json
from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow as pa

from gyre.events.models import Event
from gyre.state import Cell, ClusterState, ClusterView, TrainerState, TrainerView
from gyre.state.cluster import SKIP_PAIRS_FROM_ROWS
from gyre.state.fold import BatchColumns, Projection, on


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
    partial_rollouts: bool = False
    """The run's policy uses partial rollouts (from ``run_started``): steps take groups by ``assigned``."""
    staleness: int = 0
    group_origin: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Group -> (the batch it was queued with, the policy version when it was first queued)."""
    pool: list[str] = field(default_factory=list)
    """Complete groups not yet assigned to a train step, in completion order (partial rollouts)."""
    assigned: dict[int, list[str]] = field(default_factory=dict)
    """Train step -> the groups it trains, in the order its micro-steps take them (partial rollouts)."""
    steps_started: int = 0
    open_train: int | None = None
    """The train step started and not finished."""
    open_groups: int = 0
    """Groups the open train step trains."""

    def batch_groups(self) -> int:
        """Groups per train step: those of the first batch the log queued (every batch has as many)."""
        if not self.steps:
            return 0
        first = self.steps[min(self.steps)]
        return len(first.group_sizes) + len(first.complete_groups)

    def next_train_step(self) -> int:
        return self.open_train if self.open_train is not None else self.steps_started

    def _due(self, step: int) -> list[str]:
        """Groups ``step`` must train: first queued ``staleness + 1`` or more versions before it."""
        limit = step - self.staleness - 1
        taken = {g for groups in self.assigned.values() for g in groups}
        return [g for g, (_, version) in self.group_origin.items() if version <= limit and g not in taken]

    def assignable(self, step: int, groups: int) -> tuple[list[str], bool]:
        """Partial rollouts: the pool groups ``step`` takes now, and whether its batch is then full.

        Every *due* group is taken (the step waits for one that is not complete); the other complete
        groups of batches up to ``step + 1`` fill the rest in completion order, with room kept for the due
        groups still running, and for as many of the groups due at ``step + 1`` as that step could not
        hold (over-sampling past half a batch can queue more than a batch of them; the room binds only
        where the next step would otherwise be handed more due groups than it holds). Pure: the
        simulator's trainer and the policies read the same answer.
        """
        have = len(self.assigned.get(step, ()))
        due, due_next = set(self._due(step)), set(self._due(step + 1))
        need, reserve = groups - have, len(due)
        extra = max(0, len(due_next) - groups - len(due))  # groups due next this step must take besides
        take = []
        for g in self.pool:
            if need <= 0:
                break
            if g in due:
                take.append(g)
                need, reserve = need - 1, reserve - 1
            elif self.group_origin[g][0] <= step + 1 and need > reserve + (0 if g in due_next else extra):
                take.append(g)
                need -= 1
                if g in due_next:
                    extra = max(0, extra - 1)
        return take, need == 0

    def mean(self, what: str) -> float | None:
        """Measured mean duration of ``what`` in seconds, or None before the first one."""
        m = self.durations.get(what)
        return m.total / m.count if m is not None and m.count else None

    @property
    def training_pending(self) -> bool:
        """Some queued batch has not been trained yet: training will have work."""
        return self.untrained_steps > 0

    @property
    def untrained_steps(self) -> int:
        """Queued steps not trained yet; executions outside the steps (held-out, bucket -1) are no batch."""
        return sum(s >= 0 for s in self.steps) - len(self.trained)

    def training_ready(self) -> bool:
        """Training has data now: a step is open, or some complete group waits for the next one."""
        if self.open_train is not None:
            return True
        if self.partial_rollouts:
            return bool(self.pool)
        work = self.steps.get(self.next_train_step())
        return work is not None and bool(work.complete_groups)

    def ready_micro_steps(self, claimed: int) -> int:
        """Micro-steps of the open train step whose data is complete and that no cell has claimed yet
        (``claimed``: the step's claims so far); 0 with no open step. What one more training cell could
        start on now: the rest of the step's micro-steps wait on rollouts."""
        step = self.open_train
        if step is None or not self.planned_micro_steps:
            return 0
        if self.partial_rollouts:
            groups, total = len(self.assigned.get(step, ())), self.open_groups or self.batch_groups()
        else:
            work = self.steps.get(step)
            groups, total = (len(work.complete_groups) if work is not None else 0), self.batch_groups()
        if not total:
            return 0
        return max(0, groups * self.planned_micro_steps // total - claimed)

    def needed_groups(self) -> set[str]:
        """Groups still rolling out that the next train step needs: the rollout work it waits on.

        Without partial rollouts: the incomplete groups of the first batch not yet complete (the next
        step's own). With them: the step still lacks ``batch_groups()`` minus the groups it holds or can
        take now (if none: at staleness 0 nothing, the step's training is the critical path; at staleness
        >= 1 the step after it, counted against the groups left in the pool); it needs
        every due group still running, then as many more as it lacks, nearest completion first (fewest
        members left, oldest batch, group id: the order they will most likely complete in). Everything
        else running (over-sampled, carried, later batches) is work the next step does not wait for.
        """
        step = self.next_train_step()
        if not self.partial_rollouts:
            while step in self.steps and not self.steps[step].group_sizes:
                step += 1
            work = self.steps.get(step)
            return set(work.group_sizes) if work is not None else set()
        groups = self.batch_groups()
        if not groups:
            return set()
        take, full = self.assignable(step, groups)
        if full and not self.staleness:
            return set()  # the next batch waits for this step's weights: its training is the critical path
        if full:
            step += 1
            lacking = groups - (len(self.pool) - len(take))
            taken = set(take)
            due = {g for g in self._due(step) if g not in taken}
        else:
            lacking = groups - len(self.assigned.get(step, ())) - len(take)
            due = set(self._due(step))
        incomplete = [(left, batch, g) for batch, w in self.steps.items() if batch <= step + 1
                      for g, left in w.group_sizes.items()]
        needed = {g for _, _, g in incomplete if g in due}
        rest = sorted(t for t in incomplete if t[2] not in due)
        needed.update(g for _, _, g in rest[:max(0, lacking - len(needed))])
        return needed


class WorkView(Projection[WorkState]):
    name = "work"
    version = 3
    state_type = WorkState

    @on("run_started", "policy_params")
    def _run(self, s: WorkState, policy_params) -> None:
        try:
            params = json.loads(policy_params or "{}")
        except json.JSONDecodeError:
            params = {}
        s.partial_rollouts = bool(params.get("partial_rollouts", False))
        s.staleness = int(params.get("staleness", 0) or 0)

    @on("execution_queued", "execution_id", "group_id", "step", "policy_version")
    def _queued(self, s: WorkState, execution_id, group_id, step, policy_version) -> None:
        if execution_id in s.execution_group:  # a new attempt of an unfinished execution: same batch slot
            self._place(s, execution_id, None)
            for call in s.execution_inflight.pop(execution_id, ()):
                del s.call_execution[call]
            return
        step = -1 if step is None else step
        s.group_origin.setdefault(group_id, (step, policy_version or 0))
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

    @on("train_step_started", "step", "planned_micro_steps", "groups")
    def _step_started(self, s: WorkState, step, planned_micro_steps, groups) -> None:
        s.planned_micro_steps = planned_micro_steps
        s.steps_started += 1
        s.open_train = step
        if s.partial_rollouts:
            s.assigned[step] = []
            s.open_groups = groups or s.batch_groups()
            self._assign(s, s.open_groups)

    @staticmethod
    def _assign(s: WorkState, groups: int) -> None:
        step = s.open_train
        if step is None:
            return
        take, _ = s.assignable(step, groups)
        if take:
            s.assigned[step].extend(take)
            chosen = set(take)
            s.pool = [g for g in s.pool if g not in chosen]

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
        if s.open_train == step:
            s.open_train = None

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
            if s.partial_rollouts:
                s.pool.append(group)
                if s.open_train is not None:
                    WorkView._assign(s, s.open_groups)


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

    def apply_batch(self, batch: pa.RecordBatch, columns: BatchColumns | None = None) -> None:
        """Fold a batch of the log (as columns: no event objects), rows in seq order. A small batch (the
        controller's live ones) is read once for the three projections (``columns``: already read, by the
        controller's observers of the same batch)."""
        if batch.num_rows >= SKIP_PAIRS_FROM_ROWS:
            for projection, state in zip(self.projections, self.states, strict=True):
                projection.apply_batch(state, batch)
            return
        columns = columns if columns is not None else BatchColumns(batch)
        for projection, state in zip(self.projections, self.states, strict=True):
            projection.apply_columns(state, columns)
