"""`gyre train`: one machine, one cell, driven by the controller.

The run composes the components once, each with its own config, and hands the driving to
`gyre.controller.Controller`: it folds the log, lets the configured policy decide the core cell's role
(with one cell, elastic and colocate both train when a step's data is ready and serve rollouts otherwise),
performs the decisions through the cell's actuator and queues each step's rollouts and training as the plan
allows. The proxy, the harness runner, the trainer and the cell are producers on the controller's sink:
the controller is the run's one log writer. The loop keeps no state that the log does not also hold.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from gyre.controller import Controller, LocalCell, RunPlan, WeightStore
from gyre.errors import ConfigError
from gyre.events.models import CellRegistered, RunFinished, RunStarted
from gyre.log import LogWriter
from gyre.scheduler import CellSpec, SchedulerView, get_policy
from gyre.sink import LogSink
from gyre.train.config import TrainConfig
from gyre.train.core import StepTraining

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


def existing_run(log_path: Path) -> str | None:
    """The run id of the log in ``log_path``, if there is one."""
    if not log_path.exists() or not any(log_path.glob("*.seg")):
        return None
    from gyre.log import LogReader

    first = next(LogReader(log_path).events(to_seq=0), None)
    return first.run_id if isinstance(first, RunStarted) else "<unknown: the log does not begin with run_started>"


@dataclass
class _StepRollouts:
    version: int
    started: float
    futures: list[Future] = field(default_factory=list)
    ended: float = 0.0


class TrainingRun:
    """Owns every component of one run; `run()` drives it through the controller, `close()` stops it."""

    def __init__(self, config: TrainConfig, progress: Progress | None = None) -> None:
        from gyre.engine.client import SyncHttpEngineClient
        from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
        from gyre.engine.local.scheduler import SchedulerConfig
        from gyre.harness.config import HarnessConfig
        from gyre.harness.runner import Gate, HarnessRunner
        from gyre.harness.tasks import TaskSet
        from gyre.proxy import Proxy, ProxyConfig, ProxyServer, SamplingOverrides
        from gyre.train.core import LocalCoreTrainer
        from gyre.trainer import StepCoordinator, TorchBackend
        from gyre.trainer.config import GSPOConfig, OptimizerConfig, TorchBackendConfig

        self.config = config
        self.progress = progress or (lambda phase, figures: None)
        self.run_dir = config.run_dir
        self.log_path = self.run_dir / "log"
        held = existing_run(self.log_path)
        if held is not None:
            raise ConfigError(f"{self.run_dir} already holds the log of run {held}; give another run_dir, or "
                              f"--resume to continue that run")
        self.run_id = f"{config.name}-{uuid.uuid4().hex[:8]}"
        self.records: dict[int, StepRecord] = {}
        self._rollouts: dict[int, _StepRollouts] = {}
        self._lock = threading.Lock()
        self._closers: list[Callable[[], None]] = []
        self.policy = get_policy(config.scheduler.policy)
        self.params = self.policy.params({"staleness": config.scheduler.staleness}
                                         if config.scheduler.staleness else {})
        self.sink = LogSink(LogWriter(self.log_path, run_id=self.run_id))
        try:
            self.tasks = TaskSet.load(config.rollout.tasks)
            known = [t.id for t in self.tasks]
            self.task_ids = list(config.rollout.task_ids) or known
            unknown = [t for t in self.task_ids if t not in known]
            if unknown:
                raise ConfigError(f"rollout.task_ids names unknown task(s) {unknown}; the task set has {known}")
            harness = HarnessConfig.load(config.rollout.harness)
            overrides = {k: v for k, v in (("max_concurrency", config.rollout.max_concurrency),
                                           ("timeout_s", config.rollout.timeout_s)) if v is not None}
            harness = harness.model_copy(update=overrides)

            self.weights = WeightStore(self.run_dir, keep=config.checkpoint.keep_weights)
            self.controller = Controller(self.sink, self.policy, self.params,
                                         RunPlan(steps=config.steps, staleness=config.scheduler.staleness),
                                         cells={}, rollouts=self)
            spec = CellSpec(CELL, is_core=True, slots=harness.max_concurrency)
            role = self.policy.initial_roles([spec], self.params)[CELL]
            self.controller.record([
                RunStarted(run_id=self.run_id, name=config.name, policy=self.policy.name,
                           policy_version=self.policy.version, policy_params=self.params.model_dump_json(),
                           config=config.model_dump_json(), seed=config.seed, decision_points="explicit"),
                CellRegistered(cell_id=CELL, role=role, is_core=True, slots=spec.slots),
            ])

            engine = LocalEngine(LocalEngineConfig(
                model=config.engine.model, seed=config.seed, num_threads=config.engine.threads,
                scheduler=SchedulerConfig(max_running_requests=config.engine.max_running_requests,
                                          max_step_tokens=max(2048, config.engine.max_running_requests),
                                          seed=config.seed)))
            self.engine_server = LocalEngineServer(engine)
            engine_url = self.engine_server.start()
            self._closers.append(self.engine_server.stop)
            self.engine = SyncHttpEngineClient(engine_url)

            proxy = Proxy(ProxyConfig(engines={CELL: engine_url}, max_tokens_cap=config.sampling.max_tokens,
                                      sampling=SamplingOverrides(temperature=config.sampling.temperature,
                                                                 top_p=1.0, top_k=-1)),
                          sink=self.sink.producer("proxy"))
            self.proxy = ProxyServer(proxy)
            proxy_url = self.proxy.start()
            self._closers.append(self.proxy.stop)

            self.gate = Gate(is_open=role == "rollout")
            self.runner = HarnessRunner(harness, sink=self.sink.producer("harness"), proxy_url=proxy_url,
                                        root=self.run_dir / "executions", gate=self.gate)
            self._closers.append(lambda: self.runner.close(kill_running=True))

            from gyre.engine.local.engine import load_model

            model, _ = load_model(LocalEngineConfig(model=config.engine.model, seed=config.seed))
            model.train()
            trainer = config.trainer
            self.backend = TorchBackend(model, TorchBackendConfig(
                loss=GSPOConfig(eps_low=trainer.eps_low, eps_high=trainer.eps_high, tis_cap=trainer.tis_cap),
                optimizer=OptimizerConfig(lr=trainer.lr, weight_decay=trainer.weight_decay,
                                          max_grad_norm=trainer.max_grad_norm)))
            self.coordinator = StepCoordinator(self.sink.producer("trainer"))
            self.trainer = LocalCoreTrainer(config, cell_id=CELL, run_id=self.run_id, log_path=self.log_path,
                                            backend=self.backend, coordinator=self.coordinator,
                                            weights=self.weights, published=None, on_trained=self._trained,
                                            durable_seq=lambda: self.sink.writer.durable_seq)
            self._closers.append(self.trainer.close)
            self.cell = LocalCell(CELL, engine=self.engine, admission=self.gate, trainer=self.trainer,
                                  weights=self.weights, sink=self.sink.producer(f"cell:{CELL}"),
                                  fail=self.controller.fail, redirect=self.proxy.redirect)
            self._closers.append(self.cell.close)
            self.controller.cells[CELL] = self.cell
        except BaseException:
            self.close()
            raise

    @property
    def policy_version(self) -> int:
        return self.coordinator.state.policy_version

    # -- the rollout side (the controller's `Rollouts`) ------------------------------------------------------

    def queue(self, step: int, policy_version: int) -> None:
        """Register and submit the executions of step ``step``: ``groups_per_step`` tasks x ``group_size``."""
        from gyre.harness.runner import Execution

        config = self.config.rollout
        tasks = [self.task_ids[(step * config.groups_per_step + g) % len(self.task_ids)]
                 for g in range(config.groups_per_step)]
        rollouts = self._rollouts[step] = _StepRollouts(policy_version, time.monotonic())
        for g, task_id in enumerate(tasks):
            group_id = f"{self.run_id}.s{step}-g{g}-{task_id}"
            for i in range(config.group_size):
                execution_id = f"{self.run_id}.s{step}-g{g}-e{i}"
                registration = self.proxy.register_execution(execution_id, cell_id=CELL,
                                                             policy_version=policy_version)
                future = self.runner.submit(Execution(execution_id, self.tasks[task_id], group_id=group_id,
                                                      token=registration.token, policy_version=policy_version,
                                                      cell_id=CELL, step=step))
                future.add_done_callback(lambda _, e=execution_id, r=rollouts: self._ended(e, r))
                rollouts.futures.append(future)
        self.progress("rollout", {"step": step, "queued": len(rollouts.futures), "version": policy_version})

    def _ended(self, execution_id: str, rollouts: _StepRollouts) -> None:
        self.proxy.proxy.unregister_execution(execution_id)
        with self._lock:
            rollouts.ended = max(rollouts.ended, time.monotonic())

    def _tick(self, view: SchedulerView) -> None:
        open_steps = [s for s in self._rollouts if s not in view.work.trained]
        if open_steps:
            step = open_steps[0]
            done = sum(f.done() for f in self._rollouts[step].futures)
            self.progress("rolling", {"step": step, "queued": self.runner.queued, "running": self.runner.running,
                                      "done": done, "version": self._rollouts[step].version})

    # -- the training side (called on the cell's thread) -----------------------------------------------------

    def _trained(self, figures: StepTraining) -> None:
        rollouts = self._rollouts[figures.step]
        results = [f.result() for f in rollouts.futures]
        rewards = [r.reward for r in results if r.reward is not None]
        record = StepRecord(step=figures.step, policy_version=rollouts.version, executions=len(results),
                            scored=len(rewards), reward_mean=sum(rewards) / len(rewards) if rewards else None,
                            micro_steps=figures.micro_steps, trained_tokens=figures.trained_tokens,
                            loss=figures.loss, rollout_s=rollouts.ended - rollouts.started, train_s=figures.train_s,
                            excluded=figures.excluded or {})
        self.records[figures.step] = record
        if not figures.micro_steps:
            self.progress("skipped", {"step": figures.step, "reason": "no group had enough scored executions"})
        self.after_step(record)

    def after_step(self, record: StepRecord) -> None:
        """Once a step is trained and its weights published: progress, and the place for per-step metrics
        and held-out evaluation every N steps (they read the log and the published weights file)."""
        self.progress("step", {"record": record})

    # -- the run ------------------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        status = "completed"
        try:
            self.controller.run(tick=self._tick)
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

    def _stop_components(self) -> None:
        while self._closers:
            self._closers.pop()()

    def close(self) -> None:
        """Stop the cell, the harnesses, the proxy and the engine, then commit and close the log. Idempotent."""
        try:
            self._stop_components()
        finally:
            self.sink.close()


__all__ = ["CELL", "RunSummary", "StepRecord", "TrainingRun", "existing_run"]
