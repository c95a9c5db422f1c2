"""The core cell's trainer replica: a step's batch from the log, GSPO micro-steps, optimizer step, durable publish.

Everything it learns comes from the log (the step's groups, scoped to the run) and everything it does is an
event through the coordinator (`train_step_started` ... `train_step_finished`, `weights_published`), so
the controller's fold follows training exactly as replay will.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gyre.controller.local import Published
from gyre.controller.weights import WeightStore
from gyre.train.config import TrainConfig
from gyre.trainer import StepCoordinator, TorchBackend
from gyre.trainer.protocol import StepResult
from gyre.trajectory.source import LiveLogSource


@dataclass
class StepTraining:
    """What training one step did (the figures the CLI shows; all of it is also in the log)."""

    step: int
    micro_steps: int = 0
    trained_tokens: int = 0
    loss: float | None = None
    train_s: float = 0.0
    policy_version: int = 0
    excluded: dict[str, int] | None = None


class LocalCoreTrainer:
    def __init__(self, config: TrainConfig, *, cell_id: str, run_id: str, log_path: Path, backend: TorchBackend,
                 coordinator: StepCoordinator, weights: WeightStore, published: Published | None,
                 on_trained: Callable[[StepTraining], None], durable_seq: Callable[[], int]) -> None:
        self.config, self.cell_id, self.run_id, self.log_path = config, cell_id, run_id, log_path
        self.backend, self.coordinator, self.weights = backend, coordinator, weights
        self._published = published
        self.on_trained = on_trained
        self.durable_seq = durable_seq
        self._source: LiveLogSource | None = None

    def join(self) -> None:
        self.backend.model.train()

    def published(self) -> Published | None:
        return self._published

    def train_step(self, step: int, groups: tuple[str, ...]) -> None:
        from gyre.trainer import TrainBatch, work
        from gyre.trajectory import BatchBuilder, TrajectoryConfig

        started = time.monotonic()
        self.coordinator.sink.commit()  # every reward the fold has seen is on disk before the query
        section = self.config.trajectory
        builder = BatchBuilder(TrajectoryConfig(cap=section.cap, min_valid_per_group=section.min_valid_per_group,
                                                token_budget=section.token_budget, form=section.form))
        if self._source is None:
            self._source = LiveLogSource(self.log_path, run_id=self.run_id)
        self._source.refresh(self.durable_seq())
        micro = list(builder.batches(self._source.groups(group_ids=groups)))
        report = builder.report.to_dict()
        figures = StepTraining(step, policy_version=self.coordinator.state.policy_version,
                               excluded={k: v for k, v in report.items() if isinstance(v, int) and v
                                         and (k.startswith("excluded_") or k.startswith("groups_"))})
        batches = [TrainBatch.from_micro_batch(mb, i) for i, mb in enumerate(micro)]
        opened = self.coordinator.start_step(len(batches), groups=len(groups),
                                             trajectories=report.get("trajectories_kept", 0))
        if opened != step:
            raise RuntimeError(f"the trainer opened step {opened} for the batch of step {step}")
        if not batches:  # no group had enough scored executions: the step closes without an update
            version = self.coordinator.state.policy_version
            self.coordinator.close_step(StepResult(policy_version=version, grad_norm=0.0, normalizer=1.0),
                                        duration_s=time.monotonic() - started)
            figures.train_s = time.monotonic() - started
            self.on_trained(figures)
            return
        executions = {e for b in batches for e in b.execution_ids}
        self.coordinator.mark_ready({i: b.tokens for i, b in enumerate(batches)},
                                    {i: b.execution_ids for i, b in enumerate(batches)})
        self.backend.zero_grad()
        work(self.backend, self.coordinator, self.cell_id, batches.__getitem__)
        result = self.backend.optimizer_step(normalizer=float(len(executions)))
        summary = self.coordinator.close_step(result, duration_s=time.monotonic() - started)
        self.publish(result.policy_version)
        figures.micro_steps = len(batches)
        figures.trained_tokens = sum(b.trained_tokens for b in batches)
        figures.loss = summary.stats.loss_sum / result.normalizer
        figures.train_s = time.monotonic() - started
        self.on_trained(figures)

    def close(self) -> None:
        if self._source is not None:
            self._source.close()
            self._source = None

    def publish(self, version: int) -> None:
        stored = self.weights.save(version, dict(self.backend.named_tensors()))
        self.coordinator.publish(version, tensors=stored.tensors, nbytes=stored.bytes, location=stored.location,
                                 duration_s=stored.duration_s, sha256=stored.sha256)
        self._published = Published(version, stored.location, stored.sha256)
        self.weights.prune(version)
