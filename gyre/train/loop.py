"""The single-machine RL loop: engine, proxy, harness runner, trajectory processor, GSPO trainer.

One step: register a group of executions per task with the proxy, run them as harness subprocesses (the
harness talks to the proxy, which records every call token-in/token-out), score them, build capped,
deduplicated, weighted micro-batches of this step's groups from the log, train them as the core cell's
micro-steps, apply the optimizer step and push the new weights into the engine. Every fact goes into one
log under the run directory; the loop keeps no state that the log does not also hold.

On one machine there is one cell (`cell0`): it serves rollouts and is also the core trainer, so each step
records the two role switches it makes (rollout -> training -> rollout).
"""

import json
import time
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from gyre.events.models import (
    CellRegistered,
    RoleSwitchCompleted,
    RoleSwitchRequested,
    RunFinished,
    RunStarted,
)
from gyre.log import LogWriter
from gyre.train.config import TrainConfig

if TYPE_CHECKING:
    from gyre.evaluation import HeldOutEvaluator
    from gyre.events.models import Event

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


Progress = Callable[[str, dict], None]
"""Called with a phase name and figures; the CLI draws it with rich."""


class TrainingRun:
    """Owns every component of one run; `run()` drives the steps, `close()` stops everything cleanly."""

    def __init__(self, config: TrainConfig, progress: Progress | None = None) -> None:
        from gyre.engine.client import SyncHttpEngineClient
        from gyre.engine.local import LocalEngine, LocalEngineConfig, LocalEngineServer
        from gyre.engine.local.scheduler import SchedulerConfig
        from gyre.harness.config import HarnessConfig
        from gyre.harness.runner import HarnessRunner
        from gyre.harness.sink import LogSink as HarnessSink
        from gyre.harness.tasks import TaskSet
        from gyre.proxy import LogSink as ProxySink
        from gyre.proxy import Proxy, ProxyConfig, ProxyServer, SamplingOverrides
        from gyre.trainer import StepCoordinator, TorchBackend
        from gyre.trainer.config import GSPOConfig, OptimizerConfig, TorchBackendConfig

        self.config = config
        self.progress = progress or (lambda phase, figures: None)
        self.run_dir = config.run_dir
        self.log_path = self.run_dir / "log"
        self.run_id = f"{config.name}-{int(time.time())}"
        self._closers: list[Callable[[], None]] = []
        self.writer = LogWriter(self.log_path, run_id=self.run_id)
        try:
            self.tasks = TaskSet.load(config.rollout.tasks)
            known = [t.id for t in self.tasks]
            self.task_ids = list(config.rollout.task_ids) or known
            unknown = [t for t in self.task_ids if t not in known]
            if unknown:
                from gyre.errors import ConfigError

                raise ConfigError(f"rollout.task_ids names unknown task(s) {unknown}; the task set has {known}")
            harness = HarnessConfig.load(config.rollout.harness)
            overrides = {k: v for k, v in (("max_concurrency", config.rollout.max_concurrency),
                                           ("timeout_s", config.rollout.timeout_s)) if v is not None}
            harness = harness.model_copy(update=overrides)
            self.writer.append([
                RunStarted(run_id=self.run_id, name=config.name, policy="colocate", policy_version="train/1",
                           config=config.model_dump_json(), seed=config.seed),
                CellRegistered(cell_id=CELL, role="rollout", is_core=True,
                               slots=harness.max_concurrency),
            ])
            self.writer.commit()

            engine = LocalEngine(LocalEngineConfig(
                model=config.engine.model, seed=config.seed, num_threads=config.engine.threads,
                scheduler=SchedulerConfig(max_running_requests=config.engine.max_running_requests,
                                          max_step_tokens=max(2048, config.engine.max_running_requests),
                                          seed=config.seed)))
            self.engine_server = LocalEngineServer(engine)
            engine_url = self.engine_server.start()
            self._closers.append(self.engine_server.stop)
            self.engine = SyncHttpEngineClient(engine_url)

            # the checkpoint's own tokenizer and chat template (refused with a clear error if unusable)
            proxy = Proxy(ProxyConfig(engines={CELL: engine_url}, tokenizer=config.engine.model,
                                      max_tokens_cap=config.sampling.max_tokens,
                                      sampling=SamplingOverrides(temperature=config.sampling.temperature,
                                                                 top_p=1.0, top_k=-1)),
                          sink=ProxySink(self.writer, close_writer=False))
            self.proxy = ProxyServer(proxy)
            proxy_url = self.proxy.start()
            self._closers.append(self.proxy.stop)

            self.runner = HarnessRunner(harness, sink=HarnessSink(self.writer), proxy_url=proxy_url,
                                        root=self.run_dir / "executions")
            self._closers.append(lambda: self.runner.close(kill_running=True))

            from gyre.engine.local.engine import load_model

            model, _ = load_model(LocalEngineConfig(model=config.engine.model, seed=config.seed))
            model.train()
            trainer = config.trainer
            self.backend = TorchBackend(model, TorchBackendConfig(
                loss=GSPOConfig(eps_low=trainer.eps_low, eps_high=trainer.eps_high, tis_cap=trainer.tis_cap),
                optimizer=OptimizerConfig(lr=trainer.lr, weight_decay=trainer.weight_decay,
                                          max_grad_norm=trainer.max_grad_norm)))
            self.coordinator = StepCoordinator(self.writer)
            self.heldout = self._heldout_evaluator(HarnessSink(self.writer).record)
        except BaseException:
            self.close()
            raise
        self.policy_version = self.coordinator.state.policy_version

    # -- one step ---------------------------------------------------------------------------------------

    def step(self, step: int) -> StepRecord:
        from gyre.harness.runner import Execution

        config = self.config.rollout
        tasks = [self.task_ids[(step * config.groups_per_step + g) % len(self.task_ids)]
                 for g in range(config.groups_per_step)]
        executions = []
        for g, task_id in enumerate(tasks):
            group_id = f"s{step}-g{g}-{task_id}"
            for i in range(config.group_size):
                execution_id = f"s{step}-g{g}-e{i}"
                registration = self.proxy.register_execution(execution_id, cell_id=CELL,
                                                             policy_version=self.policy_version)
                executions.append(Execution(execution_id, self.tasks[task_id], group_id=group_id,
                                            token=registration.token, policy_version=self.policy_version,
                                            cell_id=CELL))
        self.progress("rollout", {"step": step, "queued": len(executions), "version": self.policy_version})
        started = time.monotonic()
        futures = [self.runner.submit(e) for e in executions]
        while wait(futures, timeout=0.5).not_done:
            self.progress("rolling", {"step": step, "queued": self.runner.queued, "running": self.runner.running,
                                      "done": sum(f.done() for f in futures), "version": self.policy_version})
        results = [f.result() for f in futures]
        for execution in executions:
            self.proxy.proxy.unregister_execution(execution.execution_id)
        self.writer.commit()
        rewards = [r.reward for r in results if r.reward is not None]
        record = StepRecord(step=step, policy_version=self.policy_version, executions=len(results),
                            scored=len(rewards), reward_mean=sum(rewards) / len(rewards) if rewards else None,
                            rollout_s=time.monotonic() - started)
        self.progress("rolled out", {"step": step, "reward_mean": record.reward_mean})
        self._train(step, {e.group_id for e in executions}, record)
        return record

    def _train(self, step: int, groups: set[str], record: StepRecord) -> None:
        from gyre.trainer import TrainBatch, work
        from gyre.trajectory import BatchBuilder, TrajectoryConfig
        from gyre.trajectory.source import LogSource

        started = time.monotonic()
        section = self.config.trajectory
        builder = BatchBuilder(TrajectoryConfig(cap=section.cap, min_valid_per_group=section.min_valid_per_group,
                                                token_budget=section.token_budget, form=section.form))
        micro = list(builder.batches(g for g in LogSource(self.log_path).groups() if g.group_id in groups))
        phases = {"rollout_s": record.rollout_s, "batch_s": time.monotonic() - started}
        report = builder.report.to_dict()
        record.excluded = {k: v for k, v in report.items()
                           if (k.startswith("excluded_") or k.startswith("groups_")) and isinstance(v, int) and v}
        if not micro:
            self.progress("skipped", {"step": step, "reason": "no group had enough scored executions"})
            return
        self._switch("rollout", "training", "rollouts of the step are done; the core trains")
        batches = [TrainBatch.from_micro_batch(mb, i) for i, mb in enumerate(micro)]
        executions = {e for b in batches for e in b.execution_ids}
        self.coordinator.start_step(len(batches), groups=len(groups), trajectories=report["trajectories_kept"])
        self.coordinator.mark_ready({i: b.tokens for i, b in enumerate(batches)},
                                    {i: b.execution_ids for i, b in enumerate(batches)})
        self.progress("training", {"step": step, "micro_steps": len(batches)})
        self.backend.zero_grad()
        work(self.backend, self.coordinator, CELL, batches.__getitem__)
        optimizer_started = time.monotonic()
        result = self.backend.optimizer_step(normalizer=float(len(executions)))
        phases["optimizer_s"] = time.monotonic() - optimizer_started
        summary = self.coordinator.close_step(result, duration_s=time.monotonic() - started,
                                              metrics={**builder.report.step_metrics(), **phases})
        self._publish(result.policy_version)
        self._switch("training", "rollout", "weights published; back to rollouts")
        record.micro_steps = len(batches)
        record.trained_tokens = sum(b.trained_tokens for b in batches)
        record.forwarded_tokens = summary.tokens
        record.loss = summary.stats.loss_sum / result.normalizer
        record.train_s = time.monotonic() - started

    def _publish(self, version: int) -> None:
        started = time.monotonic()
        tensors = {name: tensor.detach().clone() for name, tensor in self.backend.named_tensors()}
        response = self.engine.update_weights_from_tensor(tensors, version=str(version))
        if not response.success:
            from gyre.errors import GyreError

            raise GyreError(f"the engine refused the weights of policy version {version}: {response.message}")
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        self.coordinator.publish(version, tensors=len(tensors), nbytes=nbytes, location="engine:" + CELL,
                                 duration_s=time.monotonic() - started)
        self.policy_version = version

    def _switch(self, from_role: str, to_role: str, reason: str) -> None:
        started = time.monotonic()
        self.writer.append(RoleSwitchRequested(cell_id=CELL, from_role=from_role, to_role=to_role, reason=reason,
                                               watermark=self.runner.queued + self.runner.running))
        self.writer.append(RoleSwitchCompleted(cell_id=CELL, from_role=from_role, to_role=to_role,
                                               duration_s=time.monotonic() - started))

    # -- the run ----------------------------------------------------------------------------------------

    def run(self) -> RunSummary:
        records: list[StepRecord] = []
        status = "completed"
        try:
            for step in range(self.config.steps):
                self._evaluate(step)
                records.append(self.step(step))
                self.progress("step", {"record": records[-1]})
            self._evaluate(self.config.steps)
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except BaseException:
            status = "failed"
            raise
        finally:
            self._stop_components()  # nothing may write after run_finished
            self.writer.append(RunFinished(run_id=self.run_id, status=status,
                                           message=json.dumps({"steps": len(records)})))
            self.close()
        return RunSummary(self.log_path, records, status, self.policy_version)

    def _heldout_evaluator(self, record: Callable[["Event"], object]) -> "HeldOutEvaluator":
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

    def _stop_components(self) -> None:
        while self._closers:
            self._closers.pop()()

    def close(self) -> None:
        """Stop the harnesses, the proxy and the engine, then commit and close the log. Idempotent."""
        try:
            self._stop_components()
        finally:
            self.writer.close()
