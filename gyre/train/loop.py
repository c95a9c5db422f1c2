"""`gyre train`: one machine, one cell, driven by the controller.

The run composes the components once, each with its own config, and hands the driving to
`gyre.controller.Controller`: it folds the log, lets the configured policy decide the core cell's role
(with one cell, elastic and colocate both train when a step's data is ready and serve rollouts otherwise),
performs the decisions through the cell's actuator and queues each step's rollouts and training as the plan
allows. The proxy, the harness runner, the trainer and the cell are producers on the controller's sink:
the controller is the run's one log writer. The loop keeps no state that the log does not also hold.

Resume (``resume=True``, `gyre train CONFIG --resume`): the config must equal the one ``run_started``
recorded; the controller folds the whole log; a train step open at the crash is aborted; the trainer loads
the last checkpoint and retrains the steps after it from their logged batches (checksums must match); the
cell is brought to the role the log says (a pending switch is performed again) with the latest published
weights in its engine; harness processes the crash orphaned are killed; every execution of a queued step
that was not scored is queued again as a new attempt (only the last attempt is trained), and executions
a crash kept from being queued are queued. A scored execution is never run or rewarded again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.controller import Controller, LocalCell, RunPlan, WeightStore
from gyre.controller.plan import rollouts_to_resubmit, step_groups
from gyre.errors import ConfigError
from gyre.events.models import (
    CellRegistered,
    Event,
    ExecutionFinished,
    ExecutionQueued,
    RewardRecorded,
    RoleSwitchRequested,
    RunFinished,
    RunStarted,
)
from gyre.log import LogWriter
from gyre.scheduler import CellSpec, SchedulerView, get_policy
from gyre.sink import LogSink
from gyre.train.build import PlannedExecution, engine_config, rollout_tasks, step_plan, torch_backend
from gyre.train.config import TrainConfig
from gyre.train.core import StepTraining

if TYPE_CHECKING:
    from gyre.evaluation import HeldOutEvaluator

CELL = "cell0"


@dataclass
class StepRecord:
    """What one step did, for progress and the summary (all of it is also in the log)."""

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
    output_tokens: int = 0
    excluded: dict[str, int] = field(default_factory=dict)


@dataclass
class RunSummary:
    log: Path
    steps: list[StepRecord]
    status: str
    policy_version: int
    run_id: str = ""


Progress = Callable[[str, dict], None]
"""Called with a phase name and figures; the CLI draws it with rich."""


def run_start(log_path: Path) -> RunStarted | None:
    """The ``run_started`` of the log in ``log_path``, if there is a log."""
    if not log_path.exists() or not any(log_path.glob("*.seg")):
        return None
    from gyre.log import LogReader

    first = next(LogReader(log_path).events(to_seq=0), None)
    if not isinstance(first, RunStarted):
        raise ConfigError(f"{log_path} holds a log that does not begin with run_started; it is not a Gyre run")
    return first


def config_differences(recorded: dict, given: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(recorded) | set(given)):
        a, b = recorded.get(key), given.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: recorded {a!r}, given {b!r}")
    return out


@dataclass
class _StepFacts:
    """A step's executions and rewards as folded from the log (so a resumed run reports the same)."""

    version: int = 0
    executions: set[str] = field(default_factory=set)
    first_queued_us: int | None = None
    last_finished_us: int | None = None


class TrainingRun:
    """Owns every component of one run; `run()` drives it through the controller, `close()` stops it."""

    def __init__(self, config: TrainConfig, progress: Progress | None = None, *, resume: bool = False,
                 kill_at: tuple[str, int] | None = None) -> None:
        """``kill_at = (kind, n)``: SIGKILL this process once the controller folds the log's ``n``-th event of
        that kind (counted from the log's start, resumed events included; `gyre.train.crash`)."""
        from gyre.engine.client import SyncHttpEngineClient
        from gyre.engine.local import LocalEngine, LocalEngineServer
        from gyre.engine.protocol import INITIAL_WEIGHT_VERSION
        from gyre.harness.config import HarnessConfig
        from gyre.harness.runner import Gate, HarnessRunner
        from gyre.proxy import Proxy, ProxyConfig, ProxyServer, SamplingOverrides
        from gyre.train.core import LocalCoreTrainer
        from gyre.trainer import StepCoordinator

        self.config = config
        self.progress = progress or (lambda phase, figures: None)
        self.run_dir = config.run_dir
        self.log_path = self.run_dir / "log"
        held = run_start(self.log_path)
        if resume:
            if held is None:
                raise ConfigError(f"--resume: {self.run_dir} holds no run to resume")
            recorded = json.loads(held.config)
            differences = config_differences(recorded, json.loads(config.model_dump_json()))
            if differences:
                raise ConfigError(f"--resume: the config differs from the one run {held.run_id} started with: "
                                  + "; ".join(differences))
            self.run_id = held.run_id
        elif held is not None:
            raise ConfigError(f"{self.run_dir} already holds the log of run {held.run_id}; give another run_dir, "
                              f"or --resume to continue that run")
        else:
            self.run_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
        self.resumed = resume
        self.records: dict[int, StepRecord] = {}
        self._steps: dict[int, _StepFacts] = {}
        self._step_of: dict[str, int] = {}
        self._rewards: dict[str, float] = {}
        self._futures: list[Future] = []
        self._lock = threading.Lock()
        self._closers: list[Callable[[], None]] = []
        self.policy = get_policy(config.scheduler.policy)
        self.params = self.policy.params({"staleness": config.scheduler.staleness}
                                         if config.scheduler.staleness else {})
        self.sink = LogSink(LogWriter(self.log_path, run_id=self.run_id))
        try:
            self.tasks, self.task_ids = rollout_tasks(config.rollout)
            harness = HarnessConfig.load(config.rollout.harness)
            overrides = {k: v for k, v in (("max_concurrency", config.rollout.max_concurrency),
                                           ("timeout_s", config.rollout.timeout_s)) if v is not None}
            harness = harness.model_copy(update=overrides)

            self.weights = WeightStore(self.run_dir, keep=config.checkpoint.keep_weights)
            self.controller = Controller(self.sink, self.policy, self.params,
                                         RunPlan(steps=config.steps, staleness=config.scheduler.staleness),
                                         cells={}, rollouts=self)
            self.controller.observe(self._observe)
            if kill_at is not None:
                self.controller.observe(_killer(*kill_at))
            spec = CellSpec(CELL, is_core=True, slots=harness.max_concurrency)
            if resume:
                self.controller.catch_up(self.log_path)
                cell = self.controller.view.cluster.cells[CELL]
                role = cell.role
            else:
                role = self.policy.initial_roles([spec], self.params)[CELL]
                self.controller.record([
                    RunStarted(run_id=self.run_id, name=config.name, policy=self.policy.name,
                               policy_version=self.policy.version, policy_params=self.params.model_dump_json(),
                               config=config.model_dump_json(), seed=config.seed, decision_points="explicit"),
                    CellRegistered(cell_id=CELL, role=role, is_core=True, slots=spec.slots),
                ])

            engine = LocalEngine(engine_config(config))
            self.engine_server = LocalEngineServer(engine)
            engine_url = self.engine_server.start()
            engine.set_weight_version(INITIAL_WEIGHT_VERSION)  # calls report the version they ran on
            self._closers.append(self.engine_server.stop)
            self.engine = SyncHttpEngineClient(engine_url)

            # the checkpoint's own tokenizer and chat template (refused with a clear error if unusable)
            proxy = Proxy(ProxyConfig(engines={CELL: engine_url}, tokenizer=config.engine.model,
                                      max_tokens_cap=config.sampling.max_tokens,
                                      sampling=SamplingOverrides(temperature=config.sampling.temperature,
                                                                 top_p=1.0, top_k=-1)),
                          sink=self.sink.producer("proxy"))
            self.proxy = ProxyServer(proxy)
            proxy_url = self.proxy.start()
            self._closers.append(self.proxy.stop)

            self.gate = Gate(is_open=role == "rollout")
            self.runner = HarnessRunner(harness, sink=self.sink.producer("harness"), proxy_url=proxy_url,
                                        root=self.run_dir / "executions", gate=self.gate)

            self.backend = torch_backend(config)
            trainer_sink = self.sink.producer("trainer")
            self.coordinator = (StepCoordinator.resume(trainer_sink, self.log_path) if resume
                                else StepCoordinator(trainer_sink))
            self.trainer = LocalCoreTrainer(config, cell_id=CELL, run_id=self.run_id, log_path=self.log_path,
                                            backend=self.backend, coordinator=self.coordinator,
                                            weights=self.weights, published=None, on_trained=self._trained,
                                            durable_seq=lambda: self.sink.writer.durable_seq,
                                            rollout_s=self._rollout_s)
            self._closers.append(self.trainer.close)
            engine_version = self._restore() if resume else 0
            self.cell = LocalCell(CELL, engine=self.engine, admission=self.gate, trainer=self.trainer,
                                  weights=self.weights, sink=self.sink.producer(f"cell:{CELL}"),
                                  fail=self.controller.fail, redirect=self.proxy.redirect,
                                  engine_version=engine_version)
            self._closers.append(self.cell.close)
            # Closed first: killing the harnesses ends a drain the cell may be waiting on.
            self._closers.append(lambda: self.runner.close(kill_running=True))
            self.controller.cells[CELL] = self.cell
            self.heldout = self._heldout_evaluator(self.sink.producer("heldout").record)
            self._evaluations: list[threading.Thread] = []
            if resume:
                self._resume_cell_and_rollouts()
        except BaseException:
            self.close()
            raise

    @property
    def policy_version(self) -> int:
        return self.coordinator.state.policy_version

    # -- the rollout side (the controller's `Rollouts`) ------------------------------------------------------

    def queue(self, step: int, policy_version: int) -> None:
        """Register and submit the executions of step ``step``: ``groups_per_step`` tasks x ``group_size``."""
        for execution_id, group_id, task_id in self._step_plan(step):
            self._submit(execution_id, group_id, task_id, step, policy_version, attempt=0)
        self.progress("rollout", {"step": step, "queued": len(self._step_plan(step)), "version": policy_version})

    def _step_plan(self, step: int) -> list[PlannedExecution]:
        return step_plan(self.run_id, self.config.rollout, self.task_ids, step)

    def _submit(self, execution_id: str, group_id: str, task_id: str, step: int, policy_version: int,
                attempt: int) -> None:
        from gyre.harness.runner import Execution
        from gyre.harness.workspace import ExecutionDirs

        if self.resumed:
            set_aside(ExecutionDirs.for_execution(self.runner.root, execution_id, attempt).root)
        registration = self.proxy.register_execution(execution_id, cell_id=CELL, policy_version=policy_version,
                                                     attempt=attempt)
        future = self.runner.submit(Execution(execution_id, self.tasks[task_id], group_id=group_id,
                                              token=registration.token, policy_version=policy_version,
                                              attempt=attempt, cell_id=CELL, step=step))
        future.add_done_callback(lambda _: self.proxy.proxy.unregister_execution(execution_id))
        self._futures.append(future)

    def _observe(self, seq: int, event: Event) -> None:
        """Per-step facts for the progress figures, folded from the log on the controller's thread."""
        with self._lock:
            if isinstance(event, ExecutionQueued) and event.step is not None:
                facts = self._steps.setdefault(event.step, _StepFacts(event.policy_version))
                facts.executions.add(event.execution_id)
                self._step_of[event.execution_id] = event.step
                if facts.first_queued_us is None and event.ts is not None:
                    facts.first_queued_us = int(event.ts.timestamp() * 1e6)
            elif isinstance(event, ExecutionFinished) and event.execution_id in self._step_of:
                facts = self._steps[self._step_of[event.execution_id]]
                if event.ts is not None:
                    facts.last_finished_us = int(event.ts.timestamp() * 1e6)
            elif isinstance(event, RewardRecorded):
                self._rewards[event.execution_id] = event.reward

    def _rollout_s(self, step: int) -> float | None:
        with self._lock:
            facts = self._steps.get(step)
            if facts is None or not facts.last_finished_us or not facts.first_queued_us:
                return None
            return (facts.last_finished_us - facts.first_queued_us) / 1e6

    def _tick(self, view: SchedulerView) -> None:
        waiting = [s for s in sorted(view.work.steps) if s >= 0 and s not in view.work.trained]
        if waiting:
            work = view.work.steps[waiting[0]]
            self.progress("rolling", {"step": waiting[0], "queued": self.runner.queued,
                                      "running": self.runner.running,
                                      "done": work.executions - sum(work.group_sizes.values()),
                                      "version": view.trainer.policy_version})

    # -- the training side (called on the cell's thread) -----------------------------------------------------

    def _trained(self, figures: StepTraining) -> None:
        with self._lock:
            facts = self._steps.get(figures.step, _StepFacts())
            rewards = [self._rewards[e] for e in facts.executions if e in self._rewards]
        rollout_s = self._rollout_s(figures.step) or 0.0
        record = StepRecord(step=figures.step, policy_version=facts.version, executions=len(facts.executions),
                            scored=len(rewards), reward_mean=sum(rewards) / len(rewards) if rewards else None,
                            micro_steps=figures.micro_steps, trained_tokens=figures.trained_tokens,
                            forwarded_tokens=figures.forwarded_tokens,
                            loss=figures.loss, rollout_s=rollout_s, train_s=figures.train_s,
                            excluded=figures.excluded or {})
        self.records[figures.step] = record
        if not figures.micro_steps:
            self.progress("skipped", {"step": figures.step, "reason": "no group had enough scored executions"})
        self.after_step(record)

    # -- resume -----------------------------------------------------------------------------------------------

    def _restore(self) -> int:
        """The trainer back to the logged state; returns the weight version now in the engine."""
        aborted = self.coordinator.abort_open_step("the trainer restarted (resume)")
        view = self.controller.view
        retrained = self.trainer.restore(lambda s: step_groups(view, s))
        self.progress("resumed", {"aborted_step": aborted, "retrained_steps": retrained,
                                  "version": self.coordinator.state.policy_version})
        published = self.trainer.published()
        if published is None:
            return 0
        path = self.weights.verify(published.location, published.sha256)
        self.engine.update_weights_from_disk(str(path), version=str(published.version))
        return published.version

    def _resume_cell_and_rollouts(self) -> None:
        from gyre.log import LogReader

        view = self.controller.view
        cell = view.cluster.cells[CELL]
        if cell.switching_to is not None and cell.switching_to != cell.role:  # perform the pending decision again
            pending = [e for e in LogReader(self.log_path).events(kinds=["role_switch_requested"])
                       if isinstance(e, RoleSwitchRequested) and e.cell_id == CELL]
            self.cell.switch(pending[-1])
        elif cell.role == "training":
            self.engine.pause("abort")
        reap_orphans(self.runner.root)
        version = view.trainer.policy_version
        for r in rollouts_to_resubmit(view, queued_attempts(self.log_path, self.run_id), self._step_plan):
            self._submit(r.execution_id, r.group_id, r.task_id, r.step, version, attempt=r.attempt)

    def after_step(self, record: StepRecord) -> None:
        """Once a step is trained and its weights published: progress, and the place for per-step metrics
        and held-out evaluation every N steps (they read the log and the published weights file)."""
        self.progress("step", {"record": record})
        if record.step + 1 < self.config.steps:  # the final policy is evaluated once the controller is done
            self._evaluate_in_background(record.step + 1)

    # -- the run ------------------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        status = "completed"
        try:
            if not self.resumed:
                self._evaluate(0)  # the initial policy: the core serves until the controller decides
            self.controller.run(tick=self._tick)
            if self.heldout.plan.every:
                # The run's last step is trained: nothing is left to schedule, so the core serves the last
                # published weights again for the evaluations still due (not a scheduled role switch).
                self.cell.serve_after_run()
                for thread in self._evaluations:
                    thread.join()
                self._evaluate(self.config.steps)
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except BaseException:
            status = "failed"
            raise
        finally:
            self._stop_components()  # nothing may write after run_finished
            try:
                self.controller.record(RunFinished(run_id=self.run_id, status=status,
                                                   message=json.dumps({"steps": len(self.records)})))
            finally:
                self.close()
        steps = [self.records[s] for s in sorted(self.records)]
        return RunSummary(self.log_path, steps, status, self.policy_version, self.run_id)

    # -- held-out evaluation ----------------------------------------------------------------------------------

    def _heldout_evaluator(self, record: Callable[[Event], object]) -> HeldOutEvaluator:
        from gyre.evaluation import HeldOutEvaluator, plan_heldout
        from gyre.harness.tasks import TaskSet

        section = self.config.evaluation
        tasks = TaskSet.load(section.tasks) if section.tasks is not None else self.tasks
        trained = self.task_ids if section.tasks is None else ()
        plan = plan_heldout(section.every, tasks, section.task_ids, trained, section.samples, section.pass_threshold)

        def register(execution_id: str, version: int) -> str:
            return self.proxy.register_execution(execution_id, cell_id=CELL, policy_version=version).token

        return HeldOutEvaluator(plan, tasks, submit=self.runner.submit, register=register,
                                unregister=self.proxy.proxy.unregister_execution, record=record, cell_id=CELL)

    def _evaluate(self, steps_done: int) -> None:
        """Held-out evaluation of the policy the engine serves now, when the plan says it is due."""
        event = self.heldout.maybe_run(steps_done, self.config.steps, self.policy_version)
        if event is not None:
            self.progress("heldout", {"event": event})

    def _evaluate_in_background(self, steps_done: int) -> None:
        """Called on the cell's thread after a publish, while the core still trains: the held-out executions
        are admitted when the core serves again (its engine then holds the version just published)."""
        if self.heldout.plan.due(steps_done, self.config.steps):
            thread = threading.Thread(target=self._evaluate, args=(steps_done,), name=f"heldout-{steps_done}",
                                      daemon=True)
            self._evaluations.append(thread)
            thread.start()

    def _stop_components(self) -> None:
        while self._closers:
            self._closers.pop()()

    def close(self) -> None:
        """Stop the cell, the harnesses, the proxy and the engine, then commit and close the log. Idempotent."""
        try:
            self._stop_components()
        finally:
            self.sink.close()


def _killer(kind: str, nth: int) -> Callable[[int, Event], None]:
    seen = 0

    def observe(seq: int, event: Event) -> None:
        nonlocal seen
        if event.kind == kind:
            seen += 1
            if seen >= nth:
                os.kill(os.getpid(), signal.SIGKILL)

    return observe


def queued_attempts(log_path: Path, run_id: str) -> dict[str, tuple[int, str, str, int]]:
    """Each execution the log queued -> (its last attempt, task, group, step)."""
    from gyre.log import LogReader

    con = LogReader(log_path).duckdb()
    return {e: (a, t, g, s) for e, a, t, g, s in con.execute(
        "SELECT execution_id, max(attempt), any_value(task_id), any_value(group_id), any_value(step) "
        "FROM executions_queued WHERE run_id = ? GROUP BY execution_id", [run_id]).fetchall()}


def reap_orphans(executions_dir: Path) -> int:
    """Kill the process groups of harnesses a crash orphaned: every process working inside the run's
    execution directories (their start may never have reached the log, so their pids are not known).
    Returns how many groups were killed. Linux: reads /proc."""
    root = str(executions_dir.resolve()) + os.sep
    groups = set()
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (os.readlink(entry / "cwd") + os.sep).startswith(root):
                groups.add(os.getpgid(int(entry.name)))
        except OSError:  # gone, or not ours to look at
            continue
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            continue
    return len(groups)


def set_aside(dirs_root: Path) -> None:
    """Move an execution directory a crash left behind (its attempt never reached the log) out of the way,
    keeping it: nothing already written is deleted."""
    if dirs_root.exists():
        stale = dirs_root.parent / ".stale"
        stale.mkdir(exist_ok=True)
        dirs_root.rename(stale / f"{dirs_root.name}.{uuid.uuid4().hex[:8]}")


__all__ = ["CELL", "RunSummary", "StepRecord", "TrainingRun", "queued_attempts", "reap_orphans", "run_start",
           "set_aside"]
