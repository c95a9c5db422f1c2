"""Run configuration (`gyre train`; `gyre run` adds its sections): one TOML file, validated by pydantic."""

import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any, ClassVar, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, ValidationError

from gyre.errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RolloutSection(_Section):
    tasks: Path = Field(Path("tasks/toy/tasks.toml"), description="task set file")
    task_ids: tuple[str, ...] = Field((), description="tasks to train on (empty: all of the task set)")
    harness: Path = Field(Path("agents/toy_agent/harness.toml"), description="harness config file")
    groups_per_step: PositiveInt = Field(2, description="GSPO groups (tasks) per step")
    group_size: PositiveInt = Field(16, description="rollouts per group (the brief: 16)")
    max_concurrency: PositiveInt | None = Field(None, description="override the harness's concurrency")
    timeout_s: PositiveFloat | None = Field(None, description="override the harness's per-execution limit")


class EngineSection(_Section):
    model: str = Field("tiny", description="'tiny' (built in code from seed) or a local checkpoint directory")
    threads: PositiveInt = 1
    max_running_requests: PositiveInt = 64


class SamplingSection(_Section):
    """What the proxy imposes on every call, so that the behaviour policy is known."""

    temperature: PositiveFloat = 1.0
    max_tokens: PositiveInt = Field(128, description="cap on every call's max_tokens")
    ignore_eos: bool = Field(False, description="every call generates its whole max_tokens, whatever the model "
                                                "samples (an emulated run: the scenario's output counts hold)")


class TrajectorySection(_Section):
    cap: PositiveInt | None = Field(5, description="trajectories kept per execution (None: all)")
    min_valid_per_group: PositiveInt = 2
    token_budget: PositiveInt = Field(32_768, description="tokens per micro-batch")
    form: str = Field("packed", pattern="^(packed|expanded)$")
    micro_steps_per_group: PositiveInt | None = Field(
        None, description="cut each group into this many micro-steps, balanced by tokens (the simulator's model; "
                          "a streamed step needs it: stream_micro_steps). None: token_budget alone cuts")
    shuffle_rewards: bool = Field(False, description="control run: permute rewards within each group before "
                                                     "advantages (a gain that survives is not the reward's)")
    reward_threshold: float | None = Field(
        None, ge=0, le=1, description="train on pass/fail: a reward at or above it counts 1.0, below it 0.0, before "
                                      "advantages (the held-out pass_threshold's measure); None: the reward as graded")


class TrainerSection(_Section):
    lr: PositiveFloat = 1e-6
    eps_low: float = Field(3e-4, ge=0, lt=1)
    eps_high: float = Field(4e-4, ge=0)
    tis_cap: PositiveFloat | None = 2.0
    max_grad_norm: PositiveFloat | None = 1.0
    weight_decay: float = Field(0.0, ge=0)


class EvaluationSection(_Section):
    """Held-out evaluation: every ``every`` steps the current policy runs tasks it never trains on."""

    every: NonNegativeInt = Field(0, description="evaluate every N steps, the initial and final policy too (0: off)")
    tasks: Path | None = Field(None, description="task set file (default: rollout.tasks)")
    task_ids: tuple[str, ...] = Field((), description="held-out tasks (empty: those rollout.task_ids leaves out)")
    samples: PositiveInt = Field(1, description="rollouts per held-out task")
    pass_threshold: float = Field(1.0, ge=0, le=1, description="reward at or above which an execution passes")


class ObserveSection(_Section):
    """What follows the log of a run: exporters (while it runs) and the HTML report (when it ends)."""

    exporters: tuple[Literal["tensorboard", "wandb"], ...] = Field(
        (), description="tensorboard: event files in RUN_DIR/tensorboard; wandb: an offline run in RUN_DIR/wandb"
    )
    wandb_project: str = Field("gyre", min_length=1)
    report: bool = Field(True, description="write RUN_DIR/report.html when the run ends (gyre train, gyre run)")
class SchedulerSection(_Section):
    """The policy the controller runs (the same `decide(view, params)` as the simulator and replay)."""

    policy: str = Field("elastic", pattern="^(elastic|colocate)$",
                        description="elastic or colocate (async needs a second cell: one cell cannot be both "
                                    "fixed pools)")
    version: str | None = Field(
        None, description="a shipped version of the policy other than its current one, e.g. 'elastic/3' (None: the "
                          "current one, elastic/2); recorded in run_started, so replay re-runs the version that "
                          "decided. Its parameter rule fills in what [scheduler] params leave unset "
                          "(docs/scheduler.md)")
    staleness: NonNegativeInt = Field(0, description="steps a batch may lag the policy that trains it")
    wait_for_lent_cells: bool = Field(
        True, description="a step starts only once every cell the policy lends is in training, so it joins "
                          "from the first micro-step; off, the core starts at once and a lent cell claims what "
                          "is left when it arrives, as `gyre sim` models it (right where a micro-step outlasts "
                          "a switch, as on GPU cells; `--emulate` turns it off; the CPU toy model's micro-steps "
                          "take milliseconds, so a lent cell would arrive to a finished step)")


class CheckpointSection(_Section):
    keep_weights: PositiveInt = Field(3, description="published weight versions kept under run_dir/weights "
                                                     "(besides those a checkpoint needs)")
    every_steps: PositiveInt = Field(1, description="optimizer and trainer state saved after every N steps; "
                                                    "every checkpoint is kept")


class TrainConfig(_Section):
    name: str = Field("tiny-cpu", min_length=1)
    run_dir: Path = Field(Path("runs/tiny-cpu"), description="log, executions and checkpoints go here")
    seed: NonNegativeInt = 0
    steps: PositiveInt = 4
    rollout: RolloutSection = RolloutSection()
    engine: EngineSection = EngineSection()
    sampling: SamplingSection = SamplingSection()
    trajectory: TrajectorySection = TrajectorySection()
    trainer: TrainerSection = TrainerSection()
    evaluation: EvaluationSection = EvaluationSection()
    observe: ObserveSection = ObserveSection()
    scheduler: SchedulerSection = SchedulerSection()
    checkpoint: CheckpointSection = CheckpointSection()

    def policy_params(self) -> dict[str, Any]:
        """The policy's params as the config sets them (the policy fills in its defaults)."""
        return {"staleness": self.scheduler.staleness} if self.scheduler.staleness else {}

    @classmethod
    def load(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> Self:
        """Read and validate a TOML file; relative paths in it are relative to the current directory.

        ``overrides``: dotted keys from the command line (``{"steps": 0, "scheduler.policy": "async"}``),
        set before validation, so a bad one is refused in the same words as a bad key in the file."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config file at {path}") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path} is not valid TOML: {error}") from error
        return cls.validated(apply_overrides(data, overrides), f"{path}", set(overrides or ()))

    @classmethod
    def validated(cls, data: dict[str, Any], source: str, overridden: Collection[str] = ()) -> Self:
        """``data`` as this config, or one `ConfigError` naming every bad key (and which came from the
        command line)."""
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            problems = []
            for e in error.errors():
                key = ".".join(str(p) for p in e["loc"])
                message = (f"a {cls.kind} run has no such key or section (it would be ignored)"
                           if e["type"] == "extra_forbidden" else e["msg"])
                problems.append(f"{key}: {message}" + (" (given on the command line)" if key in overridden else ""))
            raise ConfigError(f"invalid {cls.kind} config {source}: " + "; ".join(problems)) from error

    kind: ClassVar[str] = "train"


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``data`` (a config file's tables) with the command line's dotted keys set in it, before validation."""
    for key, value in (overrides or {}).items():
        *sections, name = key.split(".")
        table = data
        for section in sections:
            table = table.setdefault(section, {})
        table[name] = value
    return data
