"""Rollout mechanics: the queue, slots, simulated model calls, decode speed, redirects, evaluation.

Mechanism, not policy: queued executions start FIFO on the settled rollout cell with the most free slots
(lowest id on ties). A running execution always has exactly one simulated call in flight; each stands for
``sim_call_s`` of agent time on a full cell.

Decode speed depends on load (``DecodeSpec``): each cell keeps a virtual clock that advances at the rate
its current batch allows (1 at the reference load, faster on a lighter cell), and a call ends when its
cell's clock has advanced by the call's reference length. The clock is re-rated whenever the batch or its
context changes, so only the cell's next due call is on the agenda. A redirected call's execution holds
its slot on the new cell but decodes nothing while its KV blocks migrate; migrations out of one leaving
cell share that cell's egress (``kv_cell_gb_per_s``), each capped at one path (``kv_gb_per_s``).

Partial rollouts: an execution still on a cell that leaves rollout without redirecting it is *cut*: its
call in flight is aborted, it is queued again (at the front: slime's buffer is consumed first) and it
later continues where it stopped (the rest of its call, then its remaining calls) under the weights of
that moment. Its work is kept, not redone, but resuming costs a re-prefill of its context:
``rollout.resume_s_per_mtoken`` seconds per million context tokens, during which it holds its slot and
decodes nothing (as a redirected call waits for its KV).

Per-call mode (``[calls] simulate = true``, ``gyre.sim.calls``): an execution runs its ``CallPlan`` call by
call. A call waits on its tools (wall time, off the cell's clock), prefills its prompt delta (wall time),
then decodes its output tokens on the cell's clock, which then runs at ``token_ms / t(n, C)`` for the ``n``
requests decoding on the cell with ``C`` tokens of context among them (requests waiting on tools are not in
the batch). Each call's record spans its wait, prefill and decode, so an execution still always has one call
in flight (a redirect moves it; a KV migration overlaps a tool wait). A run that reaches ``timeout_s`` of
time on cells is cut there, its call aborted, and finishes ``timed_out``.

Every call records the published version it started under, so a run can say how many trained
trajectories mix versions (``mixed``) and how old its oldest trained token is (``first_version``).
"""

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field, replace
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
from gyre.sim.calls import CallPlan, CallTiming, plan_calls
from gyre.sim.clock import US, to_us
from gyre.sim.scenario import Scenario
from gyre.sim.workload import ExecutionSpec

if TYPE_CHECKING:
    from gyre.sim.engine import Simulation


@dataclass(slots=True, eq=False)
class Running:
    spec: ExecutionSpec
    cell: str
    start_us: int
    call_us: int
    """Reference length of one simulated call (on a full cell)."""
    call: int = 0
    call_started_us: int = 0
    vdue: float = 0.0
    """When the current call ends, on its cell's virtual clock."""
    remaining: float = 0.0
    """Reference microseconds left in the current call while the execution migrates."""
    active: bool = False
    """Decoding on ``cell`` (false while its KV migrates)."""
    epoch: int = 0
    """Bumped whenever the execution leaves a cell's heap or a pending arrival, so stale entries are ignored."""
    since_us: int = 0
    """When the execution arrived on its current cell (for busy-time accounting)."""
    resumes: int = 0
    """Times the execution was cut and continued (partial rollouts): its later calls get new ids."""
    parent: str | None = None
    """The last call that finished: the parent of the next one."""
    plan: CallPlan | None = None
    """Per-call mode: the execution's calls (else it runs ``spec.calls`` blocks of ``call_us``)."""
    waiting: bool = False
    """Per-call mode: the call in flight is in its tool wait or prefill, until ``wait_end_us``."""
    wait_end_us: int = 0
    wait_left_us: int = 0
    """A cut execution's wait and prefill still to go when it resumes."""
    stint_us: int = 0
    """Per-call mode: when its current stretch on cells began (a cut ends one), for the timeout."""
    elapsed_us: int = 0
    """Per-call mode: time on cells before the current stretch."""
    timer: int = 0
    """Per-call mode: bumped when a stretch ends, so its timeout no longer applies."""

    def call_id(self) -> str:
        suffix = f"-r{self.resumes}" if self.resumes else ""
        return f"{self.spec.execution_id}-c{self.call}{suffix}"

    @property
    def context(self) -> int:
        """Context tokens of the call in flight (aggregate: the trajectory grows evenly over its calls)."""
        if self.plan is not None:
            return self.plan.contexts[self.call]
        return self.spec.tokens * (self.call + 1) // self.spec.calls

    @property
    def prompt(self) -> int:
        if self.plan is not None:
            return self.plan.prompt_tokens(self.call)
        return self.spec.tokens * self.call // self.spec.calls

    @property
    def last_call(self) -> bool:
        return self.call == (len(self.plan.calls) if self.plan is not None else self.spec.calls) - 1


@dataclass(slots=True)
class CellClock:
    """A cell's decode clock: ``v`` reference microseconds have passed on it by wall time ``t``."""

    v: float = 0.0
    t: int = 0
    rate: float = 1.0
    active: int = 0
    context: int = 0
    epoch: int = 0
    heap: list = field(default_factory=list)

    def advance(self, now: int) -> None:
        self.v += (now - self.t) * self.rate
        self.t = now


class DecodeCurve:
    """Progress rate of an execution on a cell as a function of the cell's batch (``DecodeSpec``).

    Aggregate mode: the whole execution progresses at ``1 / ((1 - share) + share * t(n, C) / t_ref)``.
    Per-call mode: only decoding requests are on the clock, at ``token_ms / t(n, C)`` (``CallTiming``).
    """

    def __init__(self, scenario: Scenario) -> None:
        d = scenario.decode
        self.share = d.share
        self.spec = d
        n = scenario.cluster.slots_per_cell
        self.reference_ms = self.step_ms(n, n * d.reference_context_tokens)  # > 0 when share > 0 (validated)
        self.per_call = scenario.calls.simulate
        if self.per_call:
            self.share, self.reference_ms = 1.0, CallTiming(scenario).token_ms

    def step_ms(self, requests: int, context_tokens: int) -> float:
        d = self.spec
        return d.step_ms + requests * d.per_request_ms + context_tokens / 1e6 * d.per_mtoken_ms

    def rate(self, requests: int, context_tokens: int) -> float:
        if not self.share or not requests:
            return 1.0
        slowdown = self.step_ms(requests, context_tokens) / self.reference_ms
        return 1.0 / ((1.0 - self.share) + self.share * slowdown)


def shared_transfer_s(sizes: list[float], per_flow: float, total: float | None) -> list[float]:
    """Seconds until each of ``sizes`` bytes, started together, arrives when the flows share ``total``
    bytes/s equally, each capped at ``per_flow`` (the smallest finishes first, then the rest speed up)."""
    out = [0.0] * len(sizes)
    active, sent, t = len(sizes), 0.0, 0.0
    for i in sorted(range(len(sizes)), key=sizes.__getitem__):
        rate = per_flow if total is None else min(per_flow, total / active)
        t += (sizes[i] - sent) / rate
        sent, out[i] = sizes[i], t
        active -= 1
    return out


class Rollouts:
    def __init__(self, sim: "Simulation") -> None:
        self.sim = sim
        self.queue: deque[ExecutionSpec] = deque()
        self.running: dict[str, Running] = {}
        self.finished = 0
        self.curve = DecodeCurve(sim.scenario)
        self.clocks: dict[str, CellClock] = {c.cell_id: CellClock() for c in sim.cells}
        self._order = itertools.count()
        self.suspended: dict[str, Running] = {}
        """Cut executions waiting in the queue to continue (partial rollouts)."""
        self.cuts = 0
        self.resume_s = 0.0
        """Seconds cut executions spent re-prefilling their context when they resumed."""
        self.first_version: dict[str, int] = {}
        """Execution -> the policy version its first call started under (its oldest tokens)."""
        self.mixed: set[str] = set()
        """Executions whose calls started under more than one policy version."""
        self.timing = CallTiming(sim.scenario) if sim.scenario.calls.simulate else None
        """Per-call mode (``[calls] simulate``): executions run their ``CallPlan``s."""
        self.timed_out = 0
        """Per-call mode: executions cut at their timeout."""

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
        touched = set()
        while self.queue:
            best = max(free, key=lambda f: f[0], default=None)  # first of equals: lowest id
            if best is None or best[0] <= 0:
                break
            best[0] -= 1
            self._start(self.queue.popleft(), best[1])
            touched.add(best[1])
        for cell in sorted(touched):
            self._retime(cell)

    def _start(self, spec: ExecutionSpec, cell: str) -> None:
        sim = self.sim
        now = sim.now
        run = self.suspended.pop(spec.execution_id, None)
        if run is not None:  # a cut execution continues where it stopped
            run.cell, run.since_us, run.resumes = cell, now, run.resumes + 1
            self.running[spec.execution_id] = run
            sim.emit(ExecutionStarted(ts=sim.ts, execution_id=spec.execution_id, cell_id=cell))
            self._call_started(run)
            pause_s = run.context / 1e6 * sim.scenario.rollout.resume_s_per_mtoken
            pause = to_us(pause_s)
            if run.plan is not None:
                run.wait_end_us = now + pause + run.wait_left_us  # re-prefill, then the rest of its wait
                self._arm_timeout(run)
            if pause:  # re-prefill its context before it decodes again
                self.resume_s += pause_s
                epoch = run.epoch
                sim.agenda.at(now + pause, lambda: self._arrive(run, epoch))
            else:
                self._continue(run, retime=False)
            return
        if self.timing is not None:
            plan = plan_calls(sim.scenario, spec, sim.seed, self.timing)
            run = Running(spec, cell, now, 0, since_us=now, plan=plan, stint_us=now)
            self.running[spec.execution_id] = run
            sim.emit(ExecutionStarted(ts=sim.ts, execution_id=spec.execution_id, cell_id=cell))
            self._call_started(run)
            self._arm_timeout(run)
            self._begin_call(run, retime=False)
            return
        call_us = max(1, to_us(spec.duration_s) // spec.calls)
        run = Running(spec, cell, now, call_us, since_us=now)
        self.running[spec.execution_id] = run
        sim.emit(ExecutionStarted(ts=sim.ts, execution_id=spec.execution_id, cell_id=cell))
        self._call_started(run)
        self._activate(run, cell, call_us, retime=False)

    # -- per-call mode -----------------------------------------------------------------------------------

    def _begin_call(self, run: Running, retime: bool = True) -> None:
        """The call in flight waits on its tools and prefills its prompt delta, then decodes."""
        assert run.plan is not None and self.timing is not None
        call = run.plan.calls[run.call]
        run.waiting, run.wait_end_us = True, self.sim.now + to_us(call.wait_s + self.timing.prefill_s(call))
        self._continue(run, retime)

    def _continue(self, run: Running, retime: bool = True) -> None:
        """Go on with the call in flight on ``run.cell``: the rest of its wait, or its decode."""
        if run.waiting:
            left = run.wait_end_us - self.sim.now
            if left > 0:
                epoch = run.epoch
                self.sim.agenda.at(self.sim.now + left, lambda: self._ready(run, epoch))
                return
            assert run.plan is not None and self.timing is not None
            run.waiting = False
            run.remaining = run.plan.calls[run.call].output_tokens * self.timing.token_ms * 1e3
        self._activate(run, run.cell, run.remaining, retime)

    def _ready(self, run: Running, epoch: int) -> None:
        if epoch == run.epoch and self.running.get(run.spec.execution_id) is run:
            self._continue(run)

    def _arm_timeout(self, run: Running) -> None:
        sim = self.sim
        run.stint_us = sim.now
        timer = run.timer
        left = max(1, to_us(run.plan.timeout_s) - run.elapsed_us) if run.plan is not None else 0
        sim.agenda.at(sim.now + left, lambda: self._timeout(run, timer))

    def _timeout(self, run: Running, timer: int) -> None:
        """The run reached its timeout on cells: its call in flight is aborted and it ends ``timed_out``."""
        if timer != run.timer or self.running.get(run.spec.execution_id) is not run:
            return
        self._deactivate(run)
        self._call_finished(run, aborted=True)
        self.timed_out += 1
        self._end(run, "timed_out")

    # -- the cells' decode clocks ------------------------------------------------------------------------

    def _activate(self, run: Running, cell: str, remaining: float, retime: bool = True) -> None:
        clock = self.clocks[cell]
        clock.advance(self.sim.now)
        run.active, run.vdue = True, clock.v + remaining
        heapq.heappush(clock.heap, (run.vdue, next(self._order), run, run.epoch))
        clock.active += 1
        clock.context += run.context
        if retime:
            self._retime(cell)

    def _deactivate(self, run: Running) -> float:
        """Take ``run`` off its cell's clock; return the reference microseconds left in its call."""
        run.epoch += 1
        if not run.active:
            return run.remaining  # migrating or waiting on tools: its pending arrival or wait is now stale
        clock = self.clocks[run.cell]
        clock.advance(self.sim.now)
        run.active = False
        clock.active -= 1
        clock.context -= run.context
        self._retime(run.cell)
        return max(0.0, run.vdue - clock.v)

    def _retime(self, cell: str) -> None:
        """Re-rate the cell's clock for its batch and put its next due call on the agenda."""
        sim, clock = self.sim, self.clocks[cell]
        clock.advance(sim.now)
        clock.rate = self.curve.rate(clock.active, clock.context)
        heap = clock.heap
        while heap and (heap[0][3] != heap[0][2].epoch or not heap[0][2].active):
            heapq.heappop(heap)
        clock.epoch += 1
        if heap:
            wait = math.ceil((heap[0][0] - clock.v) / clock.rate - 1e-6)
            epoch = clock.epoch
            sim.agenda.at(sim.now + max(1, wait), lambda: self._wake(cell, epoch))

    def _wake(self, cell: str, epoch: int) -> None:
        clock = self.clocks[cell]
        if epoch != clock.epoch:
            return
        clock.advance(self.sim.now)
        heap = clock.heap
        while heap and heap[0][0] <= clock.v + 1e-3:
            _, _, run, run_epoch = heapq.heappop(heap)
            if run_epoch == run.epoch and run.active:
                self._advance(run, clock)
        self._retime(cell)

    def _advance(self, run: Running, clock: CellClock) -> None:
        self._call_finished(run)
        if run.last_call or run.plan is not None:  # per-call: the next call first waits on its tools
            run.active = False
            clock.active -= 1
            clock.context -= run.context
            if run.last_call:
                self._end(run)
            else:
                run.call += 1
                self._call_started(run)
                self._begin_call(run, retime=False)  # _wake re-rates the cell
            return
        before = run.context
        run.call += 1
        clock.context += run.context - before
        self._call_started(run)
        run.vdue += run.call_us
        heapq.heappush(clock.heap, (run.vdue, next(self._order), run, run.epoch))

    # -- events ------------------------------------------------------------------------------------------

    def _call_started(self, run: Running) -> None:
        sim = self.sim
        run.call_started_us = sim.now
        prompt = run.prompt
        version = sim.trainer.published
        first = self.first_version.setdefault(run.spec.execution_id, version)
        if first != version:
            self.mixed.add(run.spec.execution_id)
        sim.emit(ModelCallStarted(ts=sim.ts, execution_id=run.spec.execution_id, call_id=run.call_id(),
                                  cell_id=run.cell, prompt_tokens=prompt, policy_version=sim.trainer.published,
                                  parent_call_id=run.parent))

    def _call_finished(self, run: Running, aborted: bool = False) -> None:
        sim = self.sim
        extra = {"finish_reason": "abort"} if aborted else {}  # a default left unset is not written
        sim.emit(ModelCallFinished(ts=sim.ts, execution_id=run.spec.execution_id, call_id=run.call_id(),
                                   cell_id=run.cell, policy_version=sim.trainer.published,
                                   latency_s=(sim.now - run.call_started_us) / US,
                                   parent_call_id=run.parent, **extra))
        if not aborted:
            run.parent = run.call_id()

    def _end(self, run: Running, status: str | None = None) -> None:
        sim, spec = self.sim, run.spec
        if run.plan is not None:  # per-call: the run, not the sample, says whether it timed out
            run.timer += 1
            status = status or ("harness_error" if run.plan.crash else "completed")
            if status != spec.status:
                spec = replace(spec, status=status)
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

    # -- redirects ---------------------------------------------------------------------------------------

    def redirect_all(self, redirects: list[Redirect], from_cell: str) -> None:
        """Move the in-flight calls (and their executions' slots) off a cell that leaves rollout.

        The calls' KV blocks leave together, so they share the cell's egress: each execution decodes
        nothing until its own blocks have arrived.
        """
        sim = self.sim
        rollout = sim.scenario.rollout
        runs = [self.running[r.execution_id] for r in redirects]
        sizes = [run.context * rollout.kv_bytes_per_token for run in runs]
        cell_bw = rollout.kv_cell_gb_per_s * 1e9 if rollout.kv_cell_gb_per_s is not None else None
        pauses = shared_transfer_s([float(b) for b in sizes], rollout.kv_gb_per_s * 1e9, cell_bw)
        targets = set()
        for redirect, run, kv_bytes, pause_s in zip(redirects, runs, sizes, pauses, strict=True):
            sim.emit(CallRedirected(ts=sim.ts, execution_id=redirect.execution_id, call_id=redirect.call_id,
                                    from_cell_id=from_cell, to_cell_id=redirect.to_cell_id,
                                    kv_blocks=-(-run.context // 16), kv_bytes=kv_bytes))
            sim.stats.rollout_busy(run.cell, sim.now - run.since_us)
            sim.stats.redirects += 1
            remaining = self._deactivate(run)
            run.cell, run.since_us = redirect.to_cell_id, sim.now
            pause = to_us(pause_s)
            if pause:
                run.remaining = remaining
                epoch = run.epoch
                sim.agenda.at(sim.now + pause, lambda r=run, e=epoch: self._arrive(r, e))
            else:
                run.remaining = remaining
                self._continue(run, retime=False)
                targets.add(run.cell)
        for cell in sorted(targets):
            self._retime(cell)

    def _arrive(self, run: Running, epoch: int) -> None:
        if epoch == run.epoch and run.spec.execution_id in self.running:
            self._continue(run)

    # -- partial rollouts --------------------------------------------------------------------------------

    def cut(self, cell: str) -> None:
        """Cut every execution still on ``cell`` (leaving rollout): abort its call, queue it again first."""
        sim = self.sim
        specs = []
        for execution_id in self.on_cell(cell):
            run = self.running.pop(execution_id)
            run.remaining = self._deactivate(run)
            if run.plan is not None:  # its timeout pauses with it; its wait goes on when it resumes
                run.timer += 1
                run.elapsed_us += sim.now - run.stint_us
                run.wait_left_us = max(0, run.wait_end_us - sim.now) if run.waiting else 0
            sim.stats.rollout_busy(run.cell, sim.now - run.since_us)
            self._call_finished(run, aborted=True)
            spec = run.spec
            sim.emit(ExecutionQueued(ts=sim.ts, execution_id=spec.execution_id, task_id=spec.task_id,
                                     group_id=spec.group_id, policy_version=sim.trainer.published, step=spec.step))
            self.suspended[execution_id] = run
            specs.append(spec)
            self.cuts += 1
        self.queue.extendleft(reversed(specs))

    def on_cell(self, cell: str) -> list[str]:
        return sorted(e for e, run in self.running.items() if run.cell == cell)
