"""The parts of a run built from its config, in one place for `gyre train` and the cluster's processes.

- `rollout_tasks`: the task set and the task ids a step cycles through (unknown ids refused, naming them);
- `step_plan`: the executions of a step, ids unique per run (pure: a resumed or remote run computes the same);
- `engine_config`: the CPU engine's config; `trainer_backend`: a trainer replica initialised as every replica
  is (the run's model from its seed, the GSPO and optimizer settings of ``[trainer]``).
Heavy packages (torch, transformers) are imported inside the builders that need them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from gyre.config import RolloutSection, TrainConfig
from gyre.errors import ConfigError

if TYPE_CHECKING:
    from gyre.emulate import Emulation
    from gyre.engine.local import LocalEngineConfig
    from gyre.harness.tasks import TaskSet
    from gyre.trainer import TorchBackend
    from gyre.trainer.config import GSPOConfig, OptimizerConfig


class PlannedExecution(NamedTuple):
    execution_id: str
    group_id: str
    task_id: str


def rollout_tasks(rollout: RolloutSection) -> tuple[TaskSet, list[str]]:
    """The task set and the ids steps cycle through (``task_ids``, or every task of the set)."""
    from gyre.harness.tasks import TaskSet

    tasks = TaskSet.load(rollout.tasks)
    known = [t.id for t in tasks]
    task_ids = list(rollout.task_ids) or known
    unknown = [t for t in task_ids if t not in known]
    if unknown:
        raise ConfigError(f"rollout.task_ids names unknown task(s) {unknown}; the task set has {known}")
    return tasks, task_ids


def step_plan(run_id: str, rollout: RolloutSection, task_ids: list[str], step: int) -> list[PlannedExecution]:
    """Every execution of ``step``: ``groups_per_step`` tasks (cycling through ``task_ids``) x ``group_size``."""
    out = []
    for g in range(rollout.groups_per_step):
        task_id = task_ids[(step * rollout.groups_per_step + g) % len(task_ids)]
        for i in range(rollout.group_size):
            out.append(PlannedExecution(f"{run_id}.s{step}-g{g}-e{i}", f"{run_id}.s{step}-g{g}-{task_id}", task_id))
    return out


def engine_config(config: TrainConfig, threads: int | None = None, emulation: Emulation | None = None
                  ) -> LocalEngineConfig:
    """``emulation``: the accelerator the engine emulates (a cluster's ``[emulate]``), or None."""
    from gyre.engine.local import LocalEngineConfig
    from gyre.engine.local.scheduler import SchedulerConfig

    return LocalEngineConfig(
        model=config.engine.model, seed=config.seed,
        num_threads=config.engine.threads if threads is None else threads, emulation=emulation,
        scheduler=SchedulerConfig(max_running_requests=config.engine.max_running_requests,
                                  max_step_tokens=max(2048, config.engine.max_running_requests), seed=config.seed))


def torch_backend(config: TrainConfig) -> TorchBackend:
    """A torch trainer replica of the run's model, in training mode."""
    from gyre.engine.local import LocalEngineConfig
    from gyre.engine.local.engine import load_model
    from gyre.trainer import TorchBackend
    from gyre.trainer.config import TorchBackendConfig

    model, _ = load_model(LocalEngineConfig(model=config.engine.model, seed=config.seed))
    model.train()
    loss, optimizer = trainer_settings(config)
    return TorchBackend(model, TorchBackendConfig(loss=loss, optimizer=optimizer))


def trainer_settings(config: TrainConfig) -> tuple[GSPOConfig, OptimizerConfig]:
    """``[trainer]`` as the backends' loss and optimizer configs."""
    from gyre.trainer.config import GSPOConfig, OptimizerConfig

    trainer = config.trainer
    return (GSPOConfig(eps_low=trainer.eps_low, eps_high=trainer.eps_high, tis_cap=trainer.tis_cap),
            OptimizerConfig(lr=trainer.lr, weight_decay=trainer.weight_decay, max_grad_norm=trainer.max_grad_norm))
