"""Scenarios: TOML files in ``replay/scenarios`` describing a cluster, a workload and its costs.

Every field is validated (unknown keys are errors) and every error names the file and the field. What each
parameter means, and where its value comes from, is in ``docs/simulator.md``.
"""

import tomllib
from pathlib import Path
from typing import Annotated

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from gyre.errors import ConfigError

SCENARIO_DIR = Path(__file__).resolve().parents[2] / "replay" / "scenarios"
Share = Annotated[float, Field(ge=0.0, le=1.0)]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ClusterSpec(_Section):
    cells: PositiveInt
    nodes_per_cell: PositiveInt
    gpus_per_node: PositiveInt = 8
    slots_per_cell: PositiveInt = Field(description="concurrent executions one cell serves in rollout")

    @property
    def gpus_per_cell(self) -> int:
        return self.nodes_per_cell * self.gpus_per_node


class BatchSpec(_Section):
    groups: PositiveInt = Field(description="GSPO groups (tasks) per train step")
    group_size: PositiveInt = 16
    micro_steps_per_group: PositiveInt = Field(
        4, description="micro-steps a complete group's trajectories are split into (GSPO needs whole groups)")


class RolloutSpec(_Section):
    timeout_s: PositiveFloat
    median_s: PositiveFloat = Field(description="median execution time of a typical task")
    task_sigma: NonNegativeFloat = Field(description="log-sd of task difficulty (shared by a group)")
    rollout_sigma: NonNegativeFloat = Field(description="log-sd between rollouts of one task")
    stall_task_share: Share = Field(0.0, description="share of tasks on which rollouts tend to stall")
    stall_prob: Share = Field(0.0, description="chance a rollout of such a task runs until the timeout")
    harness_error_rate: Share = 0.0
    tokens_per_s: PositiveFloat = Field(description="trajectory tokens per second of execution")
    token_sigma: NonNegativeFloat = 0.2
    max_tokens: PositiveInt | None = Field(
        None, description="trained tokens saturate: context compression and the 5-trajectory cap bound them")
    sim_call_s: PositiveFloat = Field(description="execution time one simulated model call stands for")
    max_sim_calls: PositiveInt = 12
    kv_bytes_per_token: NonNegativeInt = 0
    kv_gb_per_s: PositiveFloat = Field(50.0, description="KV migration bandwidth for one redirected call")


class EvaluationSpec(_Section):
    median_s: NonNegativeFloat
    sigma: NonNegativeFloat = 0.3
    failure_rate: Share = 0.0


class TrainingSpec(_Section):
    s_per_mtoken: PositiveFloat = Field(description="seconds to forward-backward a million tokens on one cell")
    optimizer_s: NonNegativeFloat = Field(description="gradient all-reduce plus optimizer step, per train step")
    publish_s: NonNegativeFloat = Field(description="pushing new weights to the rollout engines")
    satellite_join_s: NonNegativeFloat = Field(description="a satellite pulling the core's weights")


class SwitchSpec(_Section):
    to_training_s: NonNegativeFloat = 8.52
    to_rollout_s: NonNegativeFloat = 3.46


class ElasticSection(_Section):
    hysteresis_slots: NonNegativeInt = 2


class AsyncSection(_Section):
    training_cells: PositiveInt = 1


class PolicySection(_Section):
    staleness: NonNegativeInt = 0
    elastic: ElasticSection = ElasticSection()
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    async_: AsyncSection = Field(AsyncSection(), alias="async")


class RewardSpec(_Section):
    start: Share = 0.5
    end: Share = 0.5


class Targets(_Section):
    """Published figures a scenario is calibrated against (hours, or speedup ranges)."""

    elastic_hours: PositiveFloat | None = None
    colocate_hours: PositiveFloat | None = None
    async_hours: PositiveFloat | None = None
    speedup_vs_colocate: tuple[PositiveFloat, PositiveFloat] = (1.21, 1.85)
    speedup_vs_async: tuple[PositiveFloat, PositiveFloat] = (1.38, 1.78)
    tolerance: Share = 0.10


class Scenario(_Section):
    name: str
    description: str = ""
    steps: PositiveInt
    seed: int = 0
    cluster: ClusterSpec
    batch: BatchSpec
    rollout: RolloutSpec
    evaluation: EvaluationSpec
    training: TrainingSpec
    switch: SwitchSpec = SwitchSpec()
    policy: PolicySection = PolicySection()
    reward: RewardSpec = RewardSpec()
    targets: Targets = Targets()

    @model_validator(mode="after")
    def _consistent(self) -> "Scenario":
        if self.policy.async_.training_cells >= self.cluster.cells:
            raise ValueError(f"policy.async.training_cells ({self.policy.async_.training_cells}) must leave at "
                             f"least one of the {self.cluster.cells} cells for rollout")
        if self.rollout.median_s > self.rollout.timeout_s:
            raise ValueError("rollout.median_s exceeds rollout.timeout_s")
        return self


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A scenario by name (``seed-2.4t``) or path to a TOML file, with errors that name the problem."""
    path = Path(name_or_path)
    if path.suffix != ".toml":
        path = SCENARIO_DIR / f"{name_or_path}.toml"
        if not path.exists():
            raise ConfigError(f"unknown scenario {str(name_or_path)!r}; known scenarios: "
                              f"{', '.join(scenario_names())} (or give a path to a .toml file)")
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"scenario file {path} does not exist") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"scenario {path} is not valid TOML: {error}") from error
    return parse_scenario(data, source=str(path))


def parse_scenario(data: dict, source: str = "<scenario>") -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<top>'}: {e['msg']}" for e in error.errors())
        raise ConfigError(f"scenario {source} is invalid: {problems}") from error
