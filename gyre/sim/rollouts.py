"""Rollout mechanics: the queue, slots, simulated model calls, redirects, evaluation.

Mechanism, not policy: queued executions start FIFO on the settled rollout cell with the most free slots
(lowest id on ties). A running execution always has exactly one simulated call in flight; each stands for
``sim_call_s`` of real agent time. A redirected call pauses its execution while its KV blocks migrate.
"""

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gyre.events.models import (
    CallRedirected,
    EvaluationFailed,
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    ModelCallFinished,
    ModelCallStarted,
    Redirect,
    RewardRecorded,
)
from gyre.sim.clock import US, to_us
from gyre.sim.workload import ExecutionSpec

if TYPE_CHECKING:
    from gyre.sim.engine import Simulation


@dataclass(slots=True)
class Running:
    spec: ExecutionSpec
    cell: str
    start_us: int
    call_us: int
    """Length of one simulated call."""
    call: int = 0
    pause_us: int = 0
    epoch: int = 0
    """Bumped when the schedule shifts, so stale agenda entries are ignored."""
    since_us: int = 0
    """When the execution arrived on its current cell (for busy-time accounting)."""

    def call_id(self, index: int | None = None) -> str:
        return f"{self.spec.execution_id}-c{self.call if index is None else index}"

    def next_due(self) -> int:
        return self.start_us + self.pause_us + (self.call + 1) * self.call_us

    @property
    def last_call(self) -> bool:
        return self.call == self.spec.calls - 1


class Rollouts:
    def __init__(self, sim: "Simulation") -> None:
        self.sim = sim
        self.queue: deque[ExecutionSpec] = deque()
        self.running: dict[str, Running] = {}
        self.finished = 0

    def enqueue(self, batch: tuple[ExecutionSpec, ...], policy_version: int) -> None:
        sim = self.sim
        for spec in batch:
            sim.emit(ExecutionQueued(ts=sim.ts, execution_id=spec.execution_id, task_id=spec.task_id,
                                     group_id=spec.group_id, policy_version=policy_version, step=spec.step))
        self.queue.extend(batch)

    def dispatch(self) -> None:
        if not self.queue:
            return
        view = self.sim.view
        cells = view.cells_in("rollout")
        free = [[c.slots - view.load(c.cell_id), c.cell_id] for c in cells]
        while self.queue:
            best = max(free, key=lambda f: f[0], default=None)  # first of equals: lowest id
            if best is None or best[0] <= 0:
                return
            best[0] -= 1
            self._start(self.queue.popleft(), best[1])

    def _start(self, spec: ExecutionSpec, cell: str) -> None:
        sim = self.sim
        now = sim.now
        call_us = max(1, to_us(spec.duration_s) // spec.calls)
        run = Running(spec, cell, now, call_us, since_us=now)
        self.running[spec.execution_id] = run
        sim.emit(ExecutionStarted(ts=sim.ts, execution_id=spec.execution_id, cell_id=cell))
        self._call_started(run)
        self._schedule(run)

    def _call_started(self, run: Running) -> None:
        sim = self.sim
        prompt = run.spec.tokens * run.call // run.spec.calls
        sim.emit(ModelCallStarted(ts=sim.ts, execution_id=run.spec.execution_id, call_id=run.call_id(),
                                  cell_id=run.cell, prompt_tokens=prompt, policy_version=sim.trainer.published,
                                  parent_call_id=run.call_id(run.call - 1) if run.call else None))

    def _call_finished(self, run: Running) -> None:
        sim = self.sim
        sim.emit(ModelCallFinished(ts=sim.ts, execution_id=run.spec.execution_id, call_id=run.call_id(),
                                   cell_id=run.cell, policy_version=sim.trainer.published,
                                   latency_s=run.call_us / US,
                                   parent_call_id=run.call_id(run.call - 1) if run.call else None))

    def _schedule(self, run: Running) -> None:
        epoch = run.epoch
        self.sim.agenda.at(max(self.sim.now + 1, run.next_due()), lambda: self._advance(run, epoch))

    def _advance(self, run: Running, epoch: int) -> None:
        if epoch != run.epoch or run.spec.execution_id not in self.running:
            return  # rescheduled by a redirect
        self._call_finished(run)
        if run.last_call:
            self._end(run)
            return
        run.call += 1
        self._call_started(run)
        self._schedule(run)

    def _end(self, run: Running) -> None:
        sim, spec = self.sim, run.spec
        del self.running[spec.execution_id]
        sim.stats.rollout_busy(run.cell, sim.now - run.since_us)
        duration = (sim.now - run.start_us) / US
        sim.emit(ExecutionFinished(ts=sim.ts, execution_id=spec.execution_id, status=spec.status,
                                   duration_s=duration, tokens=spec.tokens))
        self.finished += 1
        if spec.status == "harness_error":
            sim.trainer.data_done(spec)
        else:
            sim.after(spec.eval_s, lambda: self._evaluated(spec))

    def _evaluated(self, spec: ExecutionSpec) -> None:
        sim = self.sim
        if spec.eval_failed:
            sim.emit(EvaluationFailed(ts=sim.ts, execution_id=spec.execution_id, error="crash",
                                      evaluator="sim", message="simulated evaluator crash: excluded"))
        else:
            sim.emit(RewardRecorded(ts=sim.ts, execution_id=spec.execution_id, reward=spec.reward,
                                    evaluator="sim", partial=spec.status == "timed_out", duration_s=spec.eval_s))
        sim.trainer.data_done(spec)

    def redirect(self, redirect: Redirect, from_cell: str) -> None:
        """Move an in-flight call (and its execution's slot) off a cell that leaves rollout."""
        sim = self.sim
        run = self.running[redirect.execution_id]
        rollout = sim.scenario.rollout
        context = run.spec.tokens * (run.call + 1) // run.spec.calls
        kv_bytes = context * rollout.kv_bytes_per_token
        sim.emit(CallRedirected(ts=sim.ts, execution_id=redirect.execution_id, call_id=redirect.call_id,
                                from_cell_id=from_cell, to_cell_id=redirect.to_cell_id,
                                kv_blocks=-(-context // 16), kv_bytes=kv_bytes))
        sim.stats.rollout_busy(run.cell, sim.now - run.since_us)
        sim.stats.redirects += 1
        run.cell, run.since_us = redirect.to_cell_id, sim.now
        pause = to_us(kv_bytes / (rollout.kv_gb_per_s * 1e9))
        if pause:
            run.pause_us += pause
            run.epoch += 1
            self._schedule(run)

    def on_cell(self, cell: str) -> list[str]:
        return sorted(e for e, run in self.running.items() if run.cell == cell)
