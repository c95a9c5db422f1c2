"""One run host for both topologies: everything a run does that does not depend on where its parts run.

`RunHost` owns the run's log writer, its controller (fold -> decide -> act) and the rules every run
follows: the checks before a run starts or resumes, ``run_started`` and ``run_finished``, each step's
executions (the plan), progress and the step records (folded from the log by `gyre.state.run.RunView`, so a
resumed run reports what the log says), held-out evaluation, resubmission after a crash, and shutdown.

A `Topology` supplies the rest: where the engines, the trainer, the proxy and the harnesses run, how a cell
is told to switch, and how executions reach the harness runner. Two exist:

- `gyre.train.inprocess.InProcess`: one cell, every component in this process (`gyre train`);
- `gyre.cluster.run.Cluster`: a controller here, each cell and the proxy its own process (`gyre run`).

Held-out evaluations are ordinary executions outside the steps (``step`` None, groups ``heldout-s{n}-…``):
the host queues them through the topology and records ``heldout_evaluated`` once the log holds every one's
outcome. The initial policy is measured before the loop starts (no step can take a cell meanwhile); an
evaluation after step ``n`` is queued when the log says the step trained, with the version it produced (a
cell serves it only once it holds that version); the loop keeps going after the plan is finished until the
last one is recorded, the policy deciding as usual (held-out work counts in the watermark).
"""

from __future__ import annotations

import gc
import json
import threading
import time
import uuid
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gyre.controller import Controller, RunPlan
from gyre.controller.plan import batch_parts, rollouts_to_resubmit
from gyre.errors import ConfigError
from gyre.events.codec import decode_kinds
from gyre.events.models import Event, RunFinished, RunStarted, TrainStepFinished
from gyre.log import LogWriter
from gyre.run.build import PlannedExecution, rollout_tasks, step_plan
from gyre.run.history import (
    RoleSpan,
    config_differences,
    heldout_recorded,
    queued_attempts,
    role_timeline,
    run_start,
)
from gyre.run.live import LiveRun
from gyre.scheduler import PolicyParams, SchedulerView, get_policy
from gyre.sink import LogSink
from gyre.state import BatchColumns
from gyre.state.run import RunState

if TYPE_CHECKING:
    from gyre.config import TrainConfig
    from gyre.evaluation import HeldOutPlan

Progress = Callable[[str, dict], None]
"""Called with a phase name and figures; the CLIs draw them with rich."""


@dataclass(frozen=True)
class Queued:
    """An execution to queue: a step's (``step`` set) or a held-out evaluation's (``step`` None)."""

    execution_id: str
    group_id: str
    task_id: str
    step: int | None
    policy_version: int
    attempt: int = 0


@dataclass
class _Evaluation:
    policy_version: int
    started: float
    executions: list[Queued]


@dataclass
class StepRecord:
    """What one step did, for progress and the summary: all of it folded from the log."""

    step: int
    policy_version: int
    executions: int
    scored: int
    reward_mean: float | None
    micro_steps: int = 0
    trained_tokens: int = 0
    forwarded_tokens: int = 0
    loss: float | None = None
    rollout_s: float = 0.0
    train_s: float = 0.0
    wall_s: float = 0.0
    """Seconds from the run's start to the step's training finishing."""


@dataclass
class RunSummary:
    run_id: str
    log: Path
    status: str
    policy: str
    policy_version: int
    wall_s: float
    steps: list[StepRecord] = field(default_factory=list)
    switches: int = 0
    timeline: list[RoleSpan] = field(default_factory=list)
    emulation: dict[str, float] | None = None
    """The emulated accelerators together (`RunState.emulation_totals`, with ``valid``: real compute overran
    its emulated time by at most the config's ``max_overrun_share``); None: nothing was emulated."""


class Topology(Protocol):
    """Where a run's parts run. The host calls these in order: `open`, `start`, then `queue` and `tick` while
    the run goes, `stop` once it is over (nothing may write after), `close` always."""

    tick_s: float

    def open(self, host: RunHost) -> None:
        """Before ``run_started``: what the run directory must hold (a resumed run reads it back)."""
        ...

    def start(self, host: RunHost) -> None:
        """After ``run_started`` (or a resumed run's catch-up): start the cells, the proxy and the harness
        runner, register the cells or reattach to them, with every cell's actuator in
        ``host.controller.cells``."""
        ...

    def queue(self, executions: list[Queued]) -> None:
        """Hand executions to the harness runner; their ``execution_queued`` is durable when this returns."""
        ...

    def tick(self, view: SchedulerView) -> None:
        """Live progress (on the controller's thread, every round)."""
        ...

    def stop(self) -> None:
        """Stop everything that may still write events: harnesses, cells, the proxy."""
        ...

    def close(self) -> None:
        ...


def run_plan(config: TrainConfig, params: PolicyParams) -> RunPlan:
    """The run's plan from its config and policy params: streamed steps where the trainer can plan them
    (``trajectory.micro_steps_per_group``), partial rollouts and over-sampling as `gyre sim` takes them."""
    rollout = config.rollout
    if params.partial_rollouts and config.evaluation.every:
        raise ConfigError("partial_rollouts with held-out evaluation (evaluation.every): held-out groups would "
                          "join the pool a partial step takes its groups from; set evaluation.every = 0")
    try:
        return RunPlan(steps=config.steps, staleness=config.scheduler.staleness,
                       stream=params.stream_micro_steps and config.trajectory.micro_steps_per_group is not None,
                       partial=params.partial_rollouts, oversample=params.oversample_groups,
                       batch_executions=rollout.groups_per_step * rollout.group_size, groups=rollout.groups_per_step,
                       wait_for_lent=config.scheduler.wait_for_lent_cells)
    except ValueError as error:
        raise ConfigError(f"scheduler.params: {error}") from error


class RunHost:
    """One run: its log, its controller and the rules above, over a `Topology`."""

    def __init__(self, config: TrainConfig, topology: Topology, progress: Progress | None = None, *,
                 resume: bool = False) -> None:
        self.config = config
        self.topology = topology
        self.progress = progress or (lambda phase, figures: None)
        self.run_dir = Path(config.run_dir)
        self.log_path = self.run_dir / "log"
        self.resumed = resume
        self.tasks, self.task_ids = rollout_tasks(config.rollout)  # unknown task ids refused before anything
        held = run_start(self.log_path)
        if resume:
            if held is None:
                raise ConfigError(f"--resume: {self.run_dir} holds no run to resume")
            differences = config_differences(json.loads(held.config), json.loads(config.model_dump_json()))
            if differences:
                raise ConfigError(f"--resume: the config differs from the one run {held.run_id} started with: "
                                  + "; ".join(differences))
            self.run_id = held.run_id
        elif held is not None:
            raise ConfigError(f"{self.run_dir} already holds the log of run {held.run_id}; give another run_dir, "
                              f"or --resume to continue that run")
        else:
            self.run_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
        try:
            self.policy = get_policy(config.scheduler.policy, config.scheduler.version)
        except ConfigError as error:
            raise ConfigError(f"scheduler.version: {error}") from error
        try:  # run_started records the version and every parameter: replay re-runs exactly this policy
            self.params = self.policy.run_params(config.policy_params())
        except ValueError as error:
            raise ConfigError(f"scheduler.params do not fit policy {self.policy.version}: {error}") from error
        if self.params.partial_rollouts and self.params.stream_micro_steps:
            # live, a partial step starts once its groups fill its batch (`gyre.controller.plan`): it does not
            # stream, and the recorded parameters say so — elastic/3 would lend cells to a step that cannot open
            # yet, and `gyre sim` on the log's parameters would predict a streamed run
            self.params = self.params.model_copy(update={"stream_micro_steps": False})
        self.heldout = self._heldout_plan()
        self.live = LiveRun()
        """Membership and run state, folded as each event is recorded (`gyre.run.live`)."""
        self._started = time.monotonic()
        self._evaluations: dict[int, _Evaluation] = {}
        """Held-out evaluations queued and not yet recorded, by the steps done before them."""
        self._lock = threading.Lock()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # the hub's loop acknowledges every peer's batches: its fdatasyncs go to the committer, never inline
        self.sink = LogSink(LogWriter(self.log_path, run_id=self.run_id), loop_commit="split")
        try:
            self.controller = Controller(self.sink, self.policy, self.params,
                                         run_plan(config, self.params),
                                         cells={}, rollouts=self)
            self.controller.observe(self.live.apply, at_record=True, kinds=self.live.kinds,
                                    columns=self.live.apply_columns)
            # steps done, outcomes of evaluations
            self.controller.observe(self._observe, kinds=self.live.kinds, columns=self._observe_columns)
            self.heldout_sink = self.sink.producer("heldout")
            topology.open(self)
            if resume:
                self.controller.catch_up(self.log_path)
            else:
                self.controller.record(RunStarted(
                    run_id=self.run_id, name=config.name, policy=self.policy.name,
                    policy_version=self.policy.version, policy_params=self.params.model_dump_json(),
                    config=config.model_dump_json(), seed=config.seed, decision_points="explicit"))
            self._caught_up = True
            topology.start(self)
        except BaseException:
            self.close()
            raise

    @property
    def policy_version(self) -> int:
        return self.controller.view.trainer.policy_version

    # -- the plan's executions (the controller's `Rollouts`) ---------------------------------------------

    def plan(self, step: int) -> list[PlannedExecution]:
        """The executions of ``step`` (pure: a resumed or remote run computes the same)."""
        return step_plan(self.run_id, self.config.rollout, self.task_ids, step)

    def queue(self, step: int, policy_version: int) -> None:
        """Queue ``step``'s batch (with partial rollouts and over-sampling: `gyre.controller.plan.batch_parts`)."""
        size = self.config.rollout.group_size
        executions = [Queued(e.execution_id, e.group_id, e.task_id, batch, policy_version)
                      for batch, groups in batch_parts(self.controller.plan, step)
                      for i, e in enumerate(self.plan(batch)) if i // size in groups]
        self.topology.queue(executions)
        self.progress("rollout", {"step": step, "queued": len(executions), "version": policy_version})

    def resubmit(self, held: list[str] | None = None) -> int:
        """Queue again, as new attempts, the step executions no harness runs any more and no reward scored
        (``held``: those a surviving proxy still runs). The rule is `rollouts_to_resubmit`'s."""
        view = self.controller.view
        triples = lambda step: [(e.execution_id, e.group_id, e.task_id) for e in self.plan(step)]  # noqa: E731
        again = rollouts_to_resubmit(view, queued_attempts(self.log_path, self.run_id), triples, held or ())
        version = view.trainer.policy_version
        self.topology.queue([Queued(r.execution_id, r.group_id, r.task_id, r.step, version, r.attempt)
                             for r in again])
        if again:
            self.progress("resubmitted", {"executions": len(again)})
        return len(again)

    # -- the log, folded --------------------------------------------------------------------------------

    def _observe(self, seq: int, event: Event) -> None:
        """On the controller's thread: step records, and held-out evaluations due or done (not for the events
        a resumed run folds as it catches up: its predecessor reported and evaluated those)."""
        if not self._caught_up:
            return
        if isinstance(event, TrainStepFinished):
            record = self.step_record(event.step)
            if not record.micro_steps:
                self.progress("skipped", {"step": event.step, "reason": "no group had enough scored executions"})
            self.progress("step", {"record": record})
            steps_done = event.step + 1
            if self.heldout.due(steps_done, self.config.steps):
                version = event.policy_version
                self.controller.submit(lambda: self._start_evaluation(steps_done, version))
        if self._evaluations:
            self._record_evaluations()

    def _observe_columns(self, first_seq: int, columns: BatchColumns) -> None:
        """``_observe`` for a producer's Arrow batch: only its finished steps become events (the lifecycle rows
        are many — a cell's batch is mostly calls and rewards — and `LiveRun` has folded them already)."""
        if not self._caught_up:
            return
        if "train_step_finished" in columns.present:
            for row, event in decode_kinds(columns.batch, {"train_step_finished"}):
                self._observe(first_seq + row, event)
        elif self._evaluations:
            self._record_evaluations()

    _caught_up = False
    """Set once the log as it stood is folded (a resumed run) or the run has started (a new one)."""

    @property
    def state(self) -> RunState:
        """The run view (read it under ``live.read`` where other threads record meanwhile)."""
        return self.live.run

    def rollout_s(self, step: int) -> float | None:
        """A step's rollout phase so far (first queued to last finished), for the trainer's step metrics."""
        facts = self.live.read(lambda live: live.run.steps.get(step))
        return facts.rollout_s if facts is not None and facts.last_finished_us else None

    def step_record(self, step: int) -> StepRecord:
        return self.live.read(lambda live: self._record(live.run, step))

    @staticmethod
    def _record(run: RunState, step: int) -> StepRecord:
        facts = run.steps[step]
        started = run.started_us
        wall_s = ((facts.trained_us or 0) - started) / 1e6 if started and facts.trained_us else 0.0
        return StepRecord(step=step, policy_version=facts.policy_version, executions=len(facts.executions),
                          scored=len(facts.rewards), reward_mean=facts.reward_mean, micro_steps=facts.micro_steps,
                          trained_tokens=facts.trained_tokens, forwarded_tokens=facts.forwarded_tokens,
                          loss=facts.loss, rollout_s=facts.rollout_s, train_s=facts.train_s, wall_s=wall_s)

    # -- held-out evaluation ------------------------------------------------------------------------------

    def _heldout_plan(self) -> HeldOutPlan:
        from gyre.evaluation import plan_heldout
        from gyre.harness.tasks import TaskSet

        section = self.config.evaluation
        self.heldout_tasks = TaskSet.load(section.tasks) if section.tasks is not None else self.tasks
        trained = self.task_ids if section.tasks is None else ()
        return plan_heldout(section.every, self.heldout_tasks, section.task_ids, trained, section.samples,
                            section.pass_threshold)

    def _start_evaluation(self, steps_done: int, policy_version: int,
                          queued: Container[str] = frozenset()) -> list[Queued]:
        """Wait for the evaluation before step ``steps_done``, and queue its executions but those in ``queued``."""
        from gyre.evaluation import heldout_executions

        executions = [Queued(execution_id, group_id, task_id, None, policy_version)
                      for execution_id, group_id, task_id in heldout_executions(self.heldout, steps_done)]
        with self._lock:
            self._evaluations[steps_done] = _Evaluation(policy_version, time.monotonic(), executions)
        self.topology.queue([e for e in executions if e.execution_id not in queued])
        return executions

    def _redo_cut_evaluation(self) -> None:
        """A resumed run: the evaluation its predecessor died running is recorded after all, if it measures the
        policy the run resumes with (the one due after the last trained step, or the initial one before any).
        Its executions the log scored count; those it queued and never scored were queued again as new attempts
        (`resubmit`); those the crash kept from being queued are queued here. An earlier evaluation cut by a
        crash measured a policy no cell serves any more: it is reported lost, never faked."""
        steps_done = len(self.records())
        recorded = heldout_recorded(self.log_path)
        lost = [n for n in range(steps_done) if self.heldout.due(n, self.config.steps) and n not in recorded]
        if lost:
            self.progress("heldout-lost", {"steps": lost})
        if steps_done in recorded or not self.heldout.due(steps_done, self.config.steps):
            return
        # the trainer's version, as the last step's train_step_finished has it
        executions = self._start_evaluation(steps_done, self.policy_version,
                                            queued_attempts(self.log_path, self.run_id))
        scored = self.live.read(lambda live: set(live.run.outcomes))
        self.progress("heldout-redo", {"step": steps_done,
                                       "unscored": sum(e.execution_id not in scored for e in executions)})

    def _record_evaluations(self) -> None:
        from gyre.evaluation import summarize

        outcomes = self.live.read(lambda live: dict(live.run.outcomes))
        with self._lock:
            done = sorted(n for n, evaluation in self._evaluations.items()
                          if all(e.execution_id in outcomes for e in evaluation.executions))
            finished = [(n, self._evaluations.pop(n)) for n in done]
            rewards = {n: [outcomes[e.execution_id] for e in evaluation.executions] for n, evaluation in finished}
        for steps_done, evaluation in finished:
            event = summarize(rewards[steps_done], self.heldout, step=steps_done,
                              policy_version=evaluation.policy_version,
                              duration_s=time.monotonic() - evaluation.started)
            self.heldout_sink.commit(self.heldout_sink.record(event))
            self.progress("heldout", {"event": event})

    def _evaluating(self) -> bool:
        with self._lock:
            return bool(self._evaluations)

    # -- the run -----------------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        """Drive the run to its end; exporters follow the log meanwhile, and the report is written after."""
        status = "completed"
        # the run's long-lived state (cells, views, topology, links) is built: out of the collector's
        # generations, a full collection no longer walks it (the controller's longest pause 96-166 -> 6-7 ms
        # at 256 cells, benchmarks/control_plane_bench.py --gc-freeze, docs/benchmarks.md)
        gc.freeze()
        try:
            with self._exporting():
                try:
                    if self.resumed:
                        self._redo_cut_evaluation()
                    elif self.heldout.due(0, self.config.steps):
                        self._start_evaluation(0, 0)
                    if not self.records():  # the initial policy is measured before any step can take a cell
                        self.controller.fold_until(lambda: not self._evaluating())
                    self.controller.run(tick=self.topology.tick, tick_s=self.topology.tick_s,
                                        hold=self._evaluating)
                except KeyboardInterrupt:
                    status = "interrupted"
                    raise
                except BaseException:
                    status = "failed"
                    raise
                finally:
                    self.topology.stop()  # nothing may write after run_finished
                    try:
                        self.controller.record(RunFinished(run_id=self.run_id, status=status,
                                                           message=json.dumps({"steps": len(self.records())})))
                    finally:
                        self.close()
        finally:
            if self.config.observe.report:
                from gyre.report import write_report

                self.progress("report", {"path": write_report(self.run_dir)})
        return self.summary(status)

    @contextmanager
    def _exporting(self) -> Iterator[None]:
        """The `[observe]` exporters (TensorBoard, W&B offline) following the log while the run goes, and
        catching up when it ends."""
        if not self.config.observe.exporters:
            yield
            return
        from gyre.observe import LogFollower, make_exporters

        exporters = make_exporters(self.config.observe.exporters, self.run_dir, run_name=self.run_id,
                                   project=self.config.observe.wandb_project)
        with LogFollower(self.log_path, exporters):
            yield

    def records(self) -> list[StepRecord]:
        return self.live.read(lambda live: [self._record(live.run, s) for s in sorted(live.run.steps)
                                            if live.run.steps[s].trained])

    def summary(self, status: str) -> RunSummary:
        switches, timeline = role_timeline(self.log_path)
        emulation = self.live.read(lambda live: live.run.emulation_totals())
        emulate = getattr(self.config, "emulate", None)
        if emulation is not None and emulate is not None:
            emulation["valid"] = float(emulation["overrun_share"] <= emulate.max_overrun_share)
        return RunSummary(self.run_id, self.log_path, status, self.policy.version, self.policy_version,
                          time.monotonic() - self._started, self.records(), switches, timeline, emulation)

    def close(self) -> None:
        """Stop everything the topology started, then commit and close the log. Idempotent."""
        try:
            self.topology.close()
        finally:
            self.sink.close()


__all__ = ["Progress", "Queued", "RunHost", "RunSummary", "StepRecord", "Topology"]
