"""Trainer mechanics: batch admission under the staleness bound, streamed micro-steps, optimizer, publish.

Mechanism shared by every policy: GSPO needs a whole group, so a group's data becomes trainable when every
member is scored or excluded; it is then cut into ``micro_steps_per_group`` micro-steps as the live
trainer cuts it (`gyre.trajectory.batches.balanced`: an execution is one packed row, never split, so a group
of 2 executions makes 2 full micro-steps and 2 empty ones), taken in the order groups complete. Any
settled training cell that has joined the step claims the next ready one.
A step starts once the core is training and its first micro-step is ready (or, without streaming, once
the whole batch is), ends with the optimizer, then the new weights are published to the rollout engines.
Batch ``s`` is queued once the published version is at least ``s - staleness``.

Partial rollouts (``partial_rollouts``, ``docs/simulator.md``): a step trains the groups
``WorkState.assignable`` gives it (due carried groups, then the first complete ones of batches up to the
next), so it does not wait for its own batch's slowest group; with ``oversample_groups`` the first groups
of the next batch are queued with each batch. The step no longer waits for its own batch to be queued:
the due rule alone bounds how stale its data may be.

Costs that depend on the layout: a micro-step's time scales with the cell's size
(``TrainingSpec.cell_s_per_mtoken``); the optimizer step adds a ring all-reduce over the ``k`` cells that
trained micro-steps of the step (``gradient_sync_s * 2(k-1)/k``); with ``share_core_link`` satellite
weight pulls and publishes share the core's egress (processor sharing), so joins that overlap each other
or a publish take longer.
"""

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gyre.emulate.link import FairShare
from gyre.events.models import (
    MicroStepClaimed,
    MicroStepFinished,
    SatelliteJoined,
    SatelliteLeft,
    TrainStepFinished,
    TrainStepStarted,
    WeightsPublished,
)
from gyre.sim.clock import US, to_us
from gyre.sim.scenario import hidden_reshard_share, reshard_share
from gyre.sim.workload import ExecutionSpec
from gyre.trajectory.batches import balanced

if TYPE_CHECKING:
    from collections.abc import Callable

    from gyre.sim.engine import Simulation


@dataclass
class OpenStep:
    step: int
    planned: int
    groups: int
    started_us: int
    next_micro: int = 0
    finished: int = 0
    tokens: int = 0
    samples: int = 0
    cells: set[str] = field(default_factory=set)
    """Cells that trained a micro-step of this step: their gradients are all-reduced."""


class SharedLink:
    """Transfers out of the core share its egress (`gyre.emulate.link.FairShare`, in microseconds).

    Each transfer is given as the time it would take alone; ``done`` receives the time it took. With
    ``first`` set (``training.core_link_first``), transfers of that kind (``"publish"`` or ``"join"``) go
    first: the others pause while one is in flight and resume where they stopped.
    """

    def __init__(self, sim: "Simulation", first: str | None = None) -> None:
        self.sim = sim
        self.share = FairShare(sim.now)
        self.active: dict[int, tuple[int, Callable[[float], None]]] = {}
        self.first = first
        self.kind: dict[int, str] = {}
        self.paused: dict[int, float] = {}
        """Transfers waiting for the first kind, with the time they still need alone."""
        self.epoch = 0
        self._ids = itertools.count()

    def start(self, alone_s: float, done: "Callable[[float], None]", kind: str = "") -> None:
        key = next(self._ids)
        self.active[key] = (self.sim.now, done)
        self.kind[key] = kind
        self.share.add(key, float(max(1, to_us(alone_s))), self.sim.now)
        self._prioritise()
        self._retime()

    def _prioritise(self) -> None:
        """Pause the other transfers while one of the first kind is in flight; resume them after."""
        if self.first is None:
            return
        remaining = self.share.remaining
        if any(self.kind[k] == self.first for k in remaining):
            for key in [k for k in remaining if self.kind[k] != self.first]:
                self.paused[key] = remaining.pop(key)
        elif self.paused:
            remaining.update(self.paused)
            self.paused.clear()

    def _retime(self) -> None:
        self.epoch += 1
        first = self.share.until_next()
        if first is not None:
            epoch = self.epoch
            wait = max(1, math.ceil(first - 1e-6))
            self.sim.agenda.at(self.sim.now + wait, lambda: self._wake(epoch))

    def _wake(self, epoch: int) -> None:
        if epoch != self.epoch:
            return
        self.share.advance(self.sim.now)
        finished = [self.active.pop(key) for key in self.share.pop_finished(1e-3)]
        self._prioritise()
        self._retime()
        for started, callback in finished:
            callback((self.sim.now - started) / US)


class Trainer:
    def __init__(self, sim: "Simulation") -> None:
        self.sim = sim
        self.partial = sim.params.partial_rollouts
        self.oversampled: dict[int, set[str]] = {}
        """Batch -> its groups already queued with the batch before it (over-sampling)."""
        self.next_batch = 0
        self.next_train = 0
        self.version = 0
        self.published = 0
        self.open: OpenStep | None = None
        self.joined: set[str] = set()
        self.busy: dict[str, int] = {}
        self.leaving: dict[str, Callable[[], None]] = {}
        self.group_tokens: dict[str, list[int]] = {}
        """Per group, its trained executions' tokens in completion order (the rows `balanced` bins)."""
        training = sim.scenario.training
        self.link = SharedLink(sim, training.core_link_first) if training.share_core_link else None
        self.shards = frozenset({sim.core_id})
        """Cells holding a shard of the optimizer state (``shard_optimizer``; else only the core)."""
        self.joined_us: dict[str, int] = {}
        """Cell -> when it joined training (``reshard_overlap``: the time its shard pull hid behind)."""
        self.held: dict[str, int] = {}
        """Cell -> the version of the weights it last trained on (``rejoin_keeps_weights``)."""
        self.left_us: dict[str, int] = {}
        """Cell -> when it last left training (``reshard_overlap``: the time its shard's send hid behind)."""
        self.streak: dict[str, int] = {}
        """Cell -> consecutive step ends it was joined at (``shard_min_steps``)."""
        sc = sim.scenario
        self.s_per_mtoken = sc.training.cell_s_per_mtoken(sc.cluster.gpus_per_cell)

    @property
    def done(self) -> bool:
        return self.published >= self.sim.workload.steps

    # -- data --------------------------------------------------------------------------------------------

    def admit(self) -> None:
        sim = self.sim
        steps = sim.workload.steps
        while self.next_batch < steps and self.published >= self.next_batch - sim.params.staleness:
            early = self.oversampled.get(self.next_batch, set())
            batch = tuple(e for e in sim.workload.batches[self.next_batch] if e.group_id not in early)
            sim.rollouts.enqueue(batch, self.published)
            self.next_batch += 1
            extra = sim.params.oversample_groups if self.partial else 0
            if extra and self.next_batch < steps and self.next_batch not in self.oversampled:
                following = sim.workload.batches[self.next_batch]
                groups = list(dict.fromkeys(e.group_id for e in following))[:extra]
                self.oversampled[self.next_batch] = set(groups)
                sim.rollouts.enqueue(tuple(e for e in following if e.group_id in groups), self.published)

    def data_done(self, spec: ExecutionSpec) -> None:
        if spec.trained:
            self.group_tokens.setdefault(spec.group_id, []).append(spec.tokens)

    def _complete_groups(self, step: int) -> list[str]:
        if self.partial:
            return self.sim.view.work.assigned.get(step, [])
        work = self.sim.view.work.steps.get(step)
        return work.complete_groups if work is not None else []

    def _can_start(self, step: int) -> bool:
        """Partial rollouts: the step has its whole batch, or (streaming) its first group while some cell
        serves rollouts: with none, a step short of groups could never fill (its rest is cut and queued)."""
        view = self.sim.view
        take, full = view.work.assignable(step, self.sim.scenario.batch.groups)
        serving = bool(view.cells_in("rollout") or view.entering("rollout"))
        return full or (self.sim.params.stream_micro_steps and bool(take) and serving)

    def _ready(self, step: int) -> int:
        batch = self.sim.scenario.batch
        complete = len(self._complete_groups(step))
        if not self.sim.params.stream_micro_steps and complete < batch.groups:
            return 0  # the whole batch first
        return complete * batch.micro_steps_per_group

    # -- steps and micro-steps ---------------------------------------------------------------------------

    def start_and_claim(self) -> None:
        sim = self.sim
        core = sim.core_id
        queued = self.next_train < (sim.workload.steps if self.partial else self.next_batch)
        if self.open is None and queued and core in self.joined and core not in self.busy:
            groups = sim.scenario.batch.groups
            if self._can_start(self.next_train) if self.partial else self._ready(self.next_train):
                planned = groups * sim.scenario.batch.micro_steps_per_group
                self.open = OpenStep(self.next_train, planned, groups, sim.now)
                sim.emit(TrainStepStarted(ts=sim.ts, step=self.next_train, policy_version=self.version,
                                          planned_micro_steps=self.open.planned, groups=groups,
                                          trajectories=groups * sim.scenario.batch.group_size))
        step = self.open
        if step is None or step.next_micro >= step.planned:
            return
        ready = self._ready(step.step)
        for cell in sorted(self.joined, key=lambda c: (c != core, c)):
            if step.next_micro >= ready:
                return
            if cell not in self.busy and cell not in self.leaving:
                self._claim(cell, step)

    def _claim(self, cell: str, step: OpenStep) -> None:
        sim = self.sim
        m = step.next_micro
        step.next_micro += 1
        per_group = sim.scenario.batch.micro_steps_per_group
        group = self._complete_groups(step.step)[m // per_group]
        share = m % per_group
        rows = self.group_tokens.get(group, [])
        tokens = sum(rows[i] for i in balanced(rows, per_group)[share])
        step.tokens += tokens
        if share == 0:
            step.samples += len(rows)
        self.busy[cell] = m
        step.cells.add(cell)
        sim.emit(MicroStepClaimed(ts=sim.ts, step=step.step, cell_id=cell, micro_step=m, tokens=tokens))
        duration = max(1, to_us(tokens / 1e6 * self.s_per_mtoken))
        sim.stats.training_busy(cell, duration)
        sim.agenda.at(sim.now + duration, lambda: self._micro_finished(cell, step, m, tokens, duration))

    def _micro_finished(self, cell: str, step: OpenStep, m: int, tokens: int, duration: int) -> None:
        sim = self.sim
        del self.busy[cell]
        sim.emit(MicroStepFinished(ts=sim.ts, step=step.step, cell_id=cell, micro_step=m, tokens=tokens,
                                   duration_s=duration / US))
        step.finished += 1
        then = self.leaving.pop(cell, None)
        if then is not None:
            then()
        if step.finished == step.planned:
            self._optimizer(step)

    def _optimizer(self, step: OpenStep) -> None:
        """The core runs the optimizer step, or with ``shard_optimizer`` every training cell joined now runs
        its shard (state shards moved first when the set changed); they are busy until it ends."""
        sim = self.sim
        training = sim.scenario.training
        self.streak = {cell: self.streak.get(cell, 0) + 1 for cell in self.joined}
        shards = frozenset({sim.core_id})
        if training.shard_optimizer:
            shards |= {cell for cell, n in self.streak.items() if n >= training.shard_min_steps}
        if training.reshard_overlap:
            since = {c: (sim.now - self.joined_us.get(c, sim.now)) / US for c in shards - self.shards}
            since |= {c: (sim.now - self.left_us.get(c, sim.now)) / US for c in self.shards - shards}
            moved = hidden_reshard_share(self.shards, shards, since,
                                         training.optimizer_state_ratio * training.satellite_join_s)
        else:
            moved = reshard_share(self.shards, shards)
        self.shards = shards
        optimizer = max(1, to_us(training.optimizer_step_s(len(step.cells), len(shards), moved)))
        for cell in sorted(shards):
            sim.stats.training_busy(cell, optimizer)
            self.busy[cell] = -1  # running the optimizer step (or its shard)
        sim.agenda.at(sim.now + optimizer, lambda: self._step_finished(step, shards))

    def _step_finished(self, step: OpenStep, shards: frozenset[str]) -> None:
        sim = self.sim
        for cell in shards:
            del self.busy[cell]
        self.version += 1
        for cell in self.joined:
            self.held[cell] = self.version
        sim.emit(TrainStepFinished(ts=sim.ts, step=step.step, policy_version=self.version, micro_steps=step.planned,
                                   samples=step.samples, tokens=step.tokens,
                                   duration_s=(sim.now - step.started_us) / US))
        self.open = None
        self.next_train += 1
        version = self.version
        publish_s = sim.scenario.training.publish_s
        if self.link is not None:
            self.link.start(publish_s, lambda took: self._published(version, took), "publish")
        else:
            sim.after(publish_s, lambda: self._published(version, publish_s))
        for cell in sorted(shards - {sim.core_id}):  # a satellite released during its shard leaves now
            then = self.leaving.pop(cell, None)
            if then is not None:
                then()

    def _published(self, version: int, took_s: float) -> None:
        sim = self.sim
        self.published = version
        sim.emit(WeightsPublished(ts=sim.ts, policy_version=version, location="sim://rollout-engines",
                                  duration_s=took_s))

    # -- cells joining and leaving -----------------------------------------------------------------------

    def arrive(self, cell: str) -> None:
        """A cell finished switching to training: the core trains at once, a satellite pulls weights first
        (with ``rejoin_keeps_weights``, not when it already holds the trainer's version)."""
        sim = self.sim
        if cell == sim.core_id:
            self.joined.add(cell)
            return
        join_s = sim.scenario.training.satellite_join_s
        if sim.scenario.training.rejoin_keeps_weights and self.held.get(cell) == self.version:
            self.join_now(cell)  # the weights it left with are still current: reloaded with its switch
            return
        if self.link is not None:
            self.link.start(join_s, lambda took: self._join(cell, took), "join")
        else:
            sim.after(join_s, lambda: self._join(cell, join_s))

    def join_now(self, cell: str, transfer_s: float = 0.0) -> None:
        sim = self.sim
        self.joined.add(cell)
        self.joined_us[cell] = sim.now
        self.held[cell] = self.version
        if cell != sim.core_id:
            step = self.open.step if self.open is not None else self.next_train
            sim.emit(SatelliteJoined(ts=sim.ts, cell_id=cell, step=step, policy_version=self.version,
                                     transfer_s=transfer_s))

    def _join(self, cell: str, took_s: float) -> None:
        state = self.sim.view.cluster.cells[cell]
        if state.role == "training" and state.switching_to is None:  # not recalled meanwhile
            self.join_now(cell, took_s)

    def release(self, cell: str, then: "Callable[[], None]") -> None:
        """Stop handing ``cell`` micro-steps; run ``then`` once its current micro-step (if any) is done."""
        sim = self.sim
        was_joined = cell in self.joined
        self.joined.discard(cell)

        def leave() -> None:
            if was_joined and cell != sim.core_id:
                step = self.open.step if self.open is not None else None
                sim.emit(SatelliteLeft(ts=sim.ts, cell_id=cell, step=step, reason="returned to rollout"))
            self.left_us[cell] = sim.now
            then()

        if cell in self.busy:
            self.leaving[cell] = leave
        else:
            leave()
