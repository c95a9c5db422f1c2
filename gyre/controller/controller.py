"""The controller: the one place a live run is driven, as fold → decide → act over the log.

Every event of the run reaches the log through the controller's `LogSink` (the proxy, the harness runner
and the trainer are producers on it); the sink tells the controller, in seq order, what it appended. The
controller's loop, on its own thread:

1. **fold** everything appended since the last round into the live projections (cluster, trainer, work:
   the `SchedulerFold` the simulator and replay use), so the view is the fold of the log prefix ending at
   ``folded_seq``;
2. **decide**: call the configured policy's pure ``decide(view, params)``; each decision is stamped with
   ``decided_at_seq = folded_seq``, recorded and made durable before anything acts on it (replay rebuilds
   the view at exactly that prefix and must get the same decisions);
3. **act**: hand each decision to its cell's actuator, then the plan's own commands (queue a step's
   rollouts, train a step: `gyre.controller.plan`). Actuators report back only by events — a role switch
   is complete when its `role_switch_completed` is folded, never when a call returns.

The loop sleeps until the sink appends something, so it costs nothing while a run waits on harnesses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import cached_property

import pyarrow as pa

from gyre.controller.actuator import CellActuator, Rollouts
from gyre.controller.plan import RunPlan, finished, next_step_to_queue, next_step_to_train, step_groups
from gyre.errors import GyreError
from gyre.events.codec import decode_kinds
from gyre.events.models import Event, RoleSwitchRequested
from gyre.scheduler import Policy, PolicyParams, SchedulerFold, SchedulerView
from gyre.sink import LogSink
from gyre.state import BatchColumns

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class _Batch:
    """A producer's Arrow batch as the sink appended it, with the rows some observer reads, decoded once
    (on the recording thread) with their seqs."""

    batch: pa.RecordBatch
    observed: list[tuple[int, Event]]

    def __len__(self) -> int:
        return self.batch.num_rows

    @cached_property
    def columns(self) -> BatchColumns:
        """The batch's columns, read once for the fold and every observer that takes them."""
        return BatchColumns(self.batch)


_Appended = tuple[int, "list[Event] | _Batch"]
"""What the sink appended from a seq on: events, or a producer's Arrow batch."""


class ControllerError(GyreError):
    """An action failed, or a decision names a cell the controller has no actuator for."""


@dataclass
class ControllerStats:
    decision_points: int = 0
    decisions: int = 0
    folded: int = 0


class Controller:
    """Folds, decides and acts for one run. Built over the run's sink before any producer records."""

    def __init__(self, sink: LogSink, policy: Policy, params: PolicyParams, plan: RunPlan,
                 cells: Mapping[str, CellActuator], rollouts: Rollouts, *, producer_id: str = "controller") -> None:
        if sink.on_record is not None:
            raise ControllerError("the sink already feeds another controller")
        self.sink = sink
        self.policy, self.params, self.plan = policy, params, plan
        self.cells = dict(cells)
        self.rollouts = rollouts
        self.fold = SchedulerFold()
        self.folded_seq = -1
        self.stats = ControllerStats()
        self.producer = sink.producer(producer_id)
        self._cond = threading.Condition()
        self._inbox: list[_Appended] = []
        self._failure: BaseException | None = None
        self._training: int | None = None
        self._decided_at = -2
        """The prefix of the last decision point: a policy decides once per prefix."""
        self._observers: list[_Observer] = []
        self._at_record: list[_Observer] = []
        self._calls: list[Callable[[], None]] = []
        sink.on_record = self._recorded

    @property
    def view(self) -> SchedulerView:
        return self.fold.view

    def observe(self, observer: Callable[[int, Event], None], *, at_record: bool = False,
                kinds: Collection[str] | None = None,
                columns: Callable[[int, BatchColumns], None] | None = None) -> None:
        """Also tell ``observer`` of each folded event and its seq (progress, metrics), on the controller's
        thread (the events handed on by the sink carry no seq of their own). ``at_record``: as each event is
        recorded instead, on the recording thread under the sink's lock (in seq order): for a state others
        must read as soon as their event is recorded; such an observer must be quick and record nothing.
        ``kinds``: only events of these kinds. A batch that arrived as Arrow is folded as columns, and only
        the rows some observer names become event objects: an observer of every kind (None) makes each
        model call of the run be decoded again. ``columns``: the observer's form for such a batch — it is
        handed the batch's columns (and the seq of its first row) instead, and none of its rows is decoded
        for it (at 256 cells, decoding the lifecycle rows an observer reads was most of the ingest thread)."""
        entry = _Observer(observer, None if kinds is None else frozenset(kinds), columns)
        (self._at_record if at_record else self._observers).append(entry)

    def catch_up(self, log_path) -> int:
        """Fold the log as it stands (a resumed run), before anything new is recorded; returns its last seq."""
        from gyre.log import LogReader

        with self._cond:
            if self._inbox:
                raise ControllerError("catch_up must come before any producer records")
        for event in LogReader(log_path).events():
            assert event.seq is not None
            self.fold.apply(event)
            for observer in self._at_record + self._observers:
                observer.tell(event.seq, event)
            self.folded_seq = event.seq
        return self.folded_seq

    # -- inputs ---------------------------------------------------------------------------------------------

    def _recorded(self, first_seq: int, events: list[Event] | pa.RecordBatch) -> None:
        appended: list[Event] | _Batch = events if isinstance(events, list) else _Batch(
            events, _decoded(self._at_record + self._observers, first_seq, events))
        if self._at_record:
            if isinstance(appended, _Batch):
                _tell_batch(self._at_record, first_seq, appended)
            else:
                for seq, event in enumerate(events, start=first_seq):
                    for observer in self._at_record:
                        observer.tell(seq, event)
        with self._cond:
            woken = bool(self._inbox)  # its wake-up is out already: the loop takes this batch with the others
            self._inbox.append((first_seq, appended))
            if not woken:
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """An actuator's action failed: the loop raises it on the controller's thread."""
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()

    def submit(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the controller's thread at its next round, after the fold (membership changes of a
        cluster run: what they read of the view must not change under them). An exception ends the run."""
        with self._cond:
            self._calls.append(call)
            self._cond.notify_all()

    def forget_training(self) -> None:
        """The core was lost mid-step: the step is trained again once a core is back (on the loop's thread)."""
        self.submit(lambda: setattr(self, "_training", None))

    def fold_now(self) -> None:
        """Fold what was appended (a resumed cluster run, before its loop starts: it reconciles the processes
        it found with the view)."""
        self._fold_new()

    def record(self, events: Event | list[Event]) -> int:
        """The controller's own facts (run start, cells), durable when this returns."""
        position = self.producer.record(events)
        self.producer.commit(position)
        return position

    # -- the loop -------------------------------------------------------------------------------------------

    def run(self, tick: Callable[[SchedulerView], None] | None = None, tick_s: float = 0.5,
            hold: Callable[[], bool] | None = None) -> None:
        """Drive the run until the plan is finished and ``hold()`` (asked once it is) is false: work the plan
        does not know of, such as held-out evaluations of the last policy, keeps the loop folding and the
        policy deciding. Raises the first failure of an action."""
        while True:
            self._wait(tick_s)
            self._fold_new()
            self._run_calls()
            if tick is not None:
                tick(self.view)
            if finished(self.view, self.plan) and (hold is None or not hold()):
                return
            if self.folded_seq != self._decided_at:
                self.step()

    def fold_until(self, done: Callable[[], bool], tick_s: float = 0.5) -> None:
        """Fold, deciding nothing, until ``done()``: work that must end before the loop starts (the initial
        policy's held-out evaluation, measured before any step can take a cell). Raises an action's failure."""
        while not done():
            self._wait(tick_s, decided=True)
            self._fold_new()

    def _run_calls(self) -> None:
        with self._cond:
            calls, self._calls = self._calls, []
        for call in calls:
            call()
            self._fold_new()
        if calls:
            self._plan()  # a membership change may have undone a plan command (a queue sent to a proxy that died)

    def step(self) -> None:
        """One round at the current prefix: decide and act, then the plan's commands."""
        self._decide()
        self._plan()

    def _wait(self, timeout_s: float, decided: bool = False) -> None:
        """Sleep until something is appended, unless the current prefix is not decided on yet or a call waits
        (``decided``: only folding is due; calls wait for the loop)."""
        with self._cond:
            idle = decided or (not self._calls and self.folded_seq == self._decided_at)
            if not self._inbox and self._failure is None and idle:
                self._cond.wait(timeout_s)
            if self._failure is not None:
                raise ControllerError(f"an action failed: {self._failure}") from self._failure

    def _fold_new(self) -> None:
        with self._cond:
            batches, self._inbox = self._inbox, []
        for first, events in _coalesced(batches):
            if first != self.folded_seq + 1:
                raise ControllerError(f"the controller folded up to seq {self.folded_seq} but was handed "
                                      f"events from seq {first}: the sink's order is broken")
            if isinstance(events, _Batch):  # folded as columns, then observed
                self.fold.apply_batch(events.batch, events.columns)
                _tell_batch(self._observers, first, events)
            else:
                for seq, event in enumerate(events, start=first):
                    self.fold.apply(event)
                    for observer in self._observers:
                        observer.tell(seq, event)
            self.folded_seq = first + len(events) - 1
            self.stats.folded += len(events)
        if self._training is not None and self._training in self.view.work.trained:
            self._training = None

    def _decide(self) -> None:
        at = self._decided_at = self.folded_seq
        decisions = self.policy.decide(self.view, self.params)
        self.stats.decision_points += 1
        if not decisions:
            return
        stamped = [d.model_copy(update={"decided_at_seq": at}) for d in decisions]
        for decision in stamped:
            if decision.cell_id not in self.cells:
                raise ControllerError(f"policy {self.policy.name} decided for cell {decision.cell_id}, "
                                      f"which has no actuator (known: {sorted(self.cells)})")
        self.record(stamped)
        self.stats.decisions += len(stamped)
        self._fold_new()  # the decisions are part of the view before anything else is decided
        for decision in stamped:
            self.cells[decision.cell_id].switch(decision)

    def _plan(self) -> None:
        view = self.view
        step = next_step_to_queue(view, self.plan)
        if step is not None:
            self.rollouts.queue(step, view.trainer.policy_version)
            self._fold_new()
        if self._training is None:
            step = next_step_to_train(view, self.plan.stream, self.plan)
            if step is not None:
                core = view.core
                assert core is not None
                self._training = step
                self.cells[core.cell_id].train(step, step_groups(view, step, self.plan))


def decisions_of(events: list[Event]) -> list[RoleSwitchRequested]:
    return [e for e in events if isinstance(e, RoleSwitchRequested)]


def _coalesced(entries: list[_Appended]) -> list[_Appended]:
    """Consecutive Arrow batches as one: a fold of a batch costs ~0.8 ms however few its rows (a cell's batch
    holds an event or two), the concatenation ~60 µs a batch (measured: 50 small batches folded one by one
    41 ms, concatenated and folded once 3.8 ms)."""
    out: list[_Appended] = []
    run: list[tuple[int, _Batch]] = []

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            table = pa.concat_tables([pa.Table.from_batches([b.batch]) for _, b in run], promote_options="default")
            merged = _Batch(table.combine_chunks().to_batches()[0], [o for _, b in run for o in b.observed])
            out.append((run[0][0], merged))
        run.clear()

    for first, events in entries:
        if isinstance(events, _Batch) and (not run or first == run[-1][0] + len(run[-1][1])):
            run.append((first, events))
            continue
        flush()
        if isinstance(events, _Batch):
            run.append((first, events))
        else:
            out.append((first, events))
    flush()
    return out


@dataclass(frozen=True)
class _Observer:
    call: Callable[[int, Event], None]
    kinds: frozenset[str] | None
    """None: every kind."""
    columns: Callable[[int, BatchColumns], None] | None = None
    """Its form for an Arrow batch (None: the batch's rows it reads, decoded)."""

    def tell(self, seq: int, event: Event) -> None:
        if self.kinds is None or event.kind in self.kinds:
            self.call(seq, event)


def _tell_batch(observers: list[_Observer], first_seq: int, appended: _Batch) -> None:
    """Each observer its batch: the columns (read once for all that take them), or the decoded rows."""
    for observer in observers:
        if observer.columns is not None:
            if observer.kinds is None or not observer.kinds.isdisjoint(appended.columns.present):
                observer.columns(first_seq, appended.columns)
        else:
            for seq, event in appended.observed:
                observer.tell(seq, event)


def _decoded(observers: list[_Observer], first_seq: int, batch: pa.RecordBatch) -> list[tuple[int, Event]]:
    """The rows of ``batch`` (appended from ``first_seq``) that an observer without a columns form reads, as
    events with their seqs."""
    kinds: frozenset[str] | None = frozenset()
    for observer in observers:
        if observer.columns is not None:
            continue
        kinds = None if kinds is None or observer.kinds is None else kinds | observer.kinds
    if kinds is not None and not kinds:
        return []
    return [(first_seq + row, event) for row, event in decode_kinds(batch, kinds)]
