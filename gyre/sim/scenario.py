"""Scenarios: TOML files in ``replay/scenarios`` describing a cluster, a workload and its costs.

Every field is validated (unknown keys are errors) and every error names the file and the field. What each
parameter means, and where its value comes from, is in ``docs/simulator.md``.
"""

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

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
    kv_gb_per_s: PositiveFloat = Field(50.0, description="KV migration bandwidth of one redirected call's path")
    kv_cell_gb_per_s: PositiveFloat | None = Field(
        None, description="a leaving cell's total egress, shared by its concurrent migrations (None: unlimited)")
    resume_s_per_mtoken: NonNegativeFloat = Field(
        0.0, description="partial rollouts: seconds a cut execution spends re-prefilling each million tokens of its "
                         "context when it resumes on a cell, before it decodes again (0: free)")


class DecodeSpec(_Section):
    """Per-request decode speed as a function of the batch a cell serves (a batching curve).

    One decode iteration of a cell costs ``step_ms + n * per_request_ms + context_mtokens * per_mtoken_ms``
    for ``n`` requests holding ``context_mtokens`` million tokens of KV; every request gets one token per
    iteration. Sampled execution durations are those of a full cell (``slots_per_cell`` requests) at
    ``reference_context_tokens`` each; a request on a lighter cell decodes faster. ``share`` is the part
    of an execution's time spent waiting on decode (the rest is tools and the environment); 0 turns the
    curve off (load-independent decode).
    """

    share: Share = Field(0.0, description="share of an execution's time spent decoding (0: load-independent)")
    step_ms: NonNegativeFloat = Field(0.0, description="per iteration whatever the batch: weights, collectives")
    per_request_ms: NonNegativeFloat = Field(0.0, description="per request per iteration (compute)")
    per_mtoken_ms: NonNegativeFloat = Field(0.0, description="per million context tokens per iteration (KV reads)")
    reference_context_tokens: PositiveInt = Field(
        100_000, description="context of one request at which the sampled durations hold")


class CallsSpec(_Section):
    """Per-call structure of an execution (``gyre.sim.calls``): how its sampled time and tokens split into
    model calls, tool waits, compactions and a stall. ``simulate = false`` (the default) keeps the
    simulator's aggregate model (blocks of ``sim_call_s``); the structure can still be materialised for a
    scenario harness. Every default reproduces the aggregate execution: the same duration on a full cell,
    the same tokens, the same number of calls."""

    simulate: bool = Field(False, description="time executions call by call (decode per token, waits, prefill)")
    s_per_call: PositiveFloat | None = Field(
        None, description="agent time one model call stands for on a full cell (None: the aggregate's "
                          "ceil(duration / sim_call_s) calls, at most max_sim_calls)")
    max_calls: PositiveInt = Field(1000, description="at most this many calls per execution (with s_per_call)")
    call_sigma: NonNegativeFloat = Field(
        0.5, description="log-sd of the lognormal weights that split a run's waits, prompt growth and output "
                         "tokens over its calls (0: even)")
    compact_at_tokens: PositiveInt | None = Field(
        None, description="a call whose context would exceed this many tokens compacts first: it starts a new "
                          "root whose prompt is a summary (None: never)")
    summary_tokens: PositiveInt = Field(20_000, description="the prompt of the root a compaction starts")
    prefill_s_per_mtoken: NonNegativeFloat | None = Field(
        None, description="seconds to prefill a million new prompt tokens (None: rollout.resume_s_per_mtoken)")


class EvaluationSpec(_Section):
    median_s: NonNegativeFloat
    sigma: NonNegativeFloat = 0.3
    failure_rate: Share = 0.0


class TrainingSpec(_Section):
    s_per_mtoken: PositiveFloat = Field(description="seconds to forward-backward a million tokens on one cell")
    optimizer_s: NonNegativeFloat = Field(description="gradient all-reduce plus optimizer step, per train step")
    publish_s: NonNegativeFloat = Field(description="pushing new weights to the rollout engines")
    satellite_join_s: NonNegativeFloat = Field(description="a satellite pulling the core's weights")
    gradient_sync_s: NonNegativeFloat = Field(
        0.0, description="ring all-reduce of gradients between two cells; k contributing cells cost 2(k-1)/k of it")
    share_core_link: bool = Field(
        False, description="satellite weight pulls and publishes share the core's egress (each time is alone)")
    core_link_first: Literal["publish", "join"] | None = Field(
        None, description="with share_core_link: publishes (or satellite weight pulls) go first on the core's "
                          "egress, the others pause meanwhile (None: all share it evenly)")
    reference_gpus: PositiveInt | None = Field(
        None, description="cell size s_per_mtoken was measured on (None: this scenario's cells)")
    scaling_exponent: NonNegativeFloat = Field(
        1.0, description="training time scales as (reference_gpus / gpus_per_cell) ** scaling_exponent")
    shard_optimizer: bool = Field(
        False, description="the optimizer step is sharded over the training cells joined when a step's last "
                            "micro-step ends (ZeRO-1, Megatron's distributed optimizer): each runs optimizer_s / k "
                            "(False: the core runs all of it)")
    optimizer_state_ratio: NonNegativeFloat = Field(
        6.0, description="with shard_optimizer: optimizer-state bytes per published weight byte (fp32 master "
                         "weights and Adam moments, 12 B/param, against bf16 weights, 2 B/param); a cell that "
                         "gains or gives up a shard moves it at the weight pull's rate (satellite_join_s)")
    shard_min_steps: PositiveInt = Field(
        1, description="with shard_optimizer: a satellite takes a shard only once it has been joined at this many "
                       "consecutive step ends (1: at once); short loans then never move optimizer state")
    reshard_overlap: bool = Field(
        False, description="with shard_optimizer: a cell that gains a shard pulls it while it trains its "
                           "micro-steps (the link carries nothing else between gradient syncs), so the step pays "
                           "only what the time since it joined did not hide; a cell that gives its shard up "
                           "sends it from host memory from when it left, the same way")
    rejoin_keeps_weights: bool = Field(
        False, description="a satellite that switches back to training while the weights it last trained on are "
                           "still the trainer's (no optimizer step since it left) reloads them from its host memory "
                           "as part of its switch (offloaded there when it left) instead of pulling them from the "
                           "core again (False: every join pulls satellite_join_s)")

    def cell_s_per_mtoken(self, gpus_per_cell: int) -> float:
        """Seconds per million tokens on a cell of ``gpus_per_cell`` GPUs."""
        reference = self.reference_gpus or gpus_per_cell
        return self.s_per_mtoken * (reference / gpus_per_cell) ** self.scaling_exponent

    def optimizer_step_s(self, contributing: int, shards: int = 1, moved_share: float = 0.0) -> float:
        """The optimizer step's wall time: the gradient all-reduce over the ``contributing`` cells (sharded,
        a ring reduce-scatter plus all-gather: the same volume), the update split over ``shards`` cells, and
        first, when the shard set changed, the largest share of the optimizer state one cell moves
        (``moved_share``, ``reshard_share``). Without ``shard_optimizer`` the core runs the whole update."""
        k = max(1, contributing)
        sync = self.gradient_sync_s * 2 * (k - 1) / k
        if not self.shard_optimizer:
            return self.optimizer_s + sync
        moved = moved_share * self.optimizer_state_ratio * self.satellite_join_s
        return moved + self.optimizer_s / max(1, shards) + sync


def _shard_moves(before: frozenset[str], after: frozenset[str]) -> list[tuple[float, str]]:
    """(share, cell) of each cell that moves optimizer state when the shard set changes from ``before`` to
    ``after`` (each holds an even shard): a cell that gains a shard receives ``1/len(after)``, one that gives
    its shard up sends ``1/len(before)``; cells that keep theirs re-balance the rest in parallel, each by less
    than either."""
    if not before or not after:
        raise ValueError("a shard set holds at least the core")
    return [(1 / len(after), c) for c in after - before] + [(1 / len(before), c) for c in before - after]


def reshard_share(before: frozenset[str], after: frozenset[str]) -> float:
    """The largest share of the optimizer state one cell sends or receives when the shard set changes from
    ``before`` to ``after`` (`_shard_moves`); 0 when the set is unchanged."""
    return max((share for share, _ in _shard_moves(before, after)), default=0.0)


def hidden_reshard_share(before: frozenset[str], after: frozenset[str], since_s: dict[str, float],
                         move_s: float) -> float:
    """``reshard_share`` less what each moving cell moved in the background (``reshard_overlap``): a cell
    that gains a shard pulls it from when it joined, one that gives its shard up sends it from when it left
    (from host memory, as colocate offloads its state); ``since_s`` is those seconds per cell, ``move_s`` the
    time of moving the whole optimizer state. What is left stalls the step, as ``reshard_share`` does."""
    moves = _shard_moves(before, after)
    if move_s <= 0:
        return 0.0
    return max((max(0.0, share - since_s.get(c, 0.0) / move_s) for share, c in moves), default=0.0)


class SwitchSpec(_Section):
    to_training_s: NonNegativeFloat = 8.52
    to_rollout_s: NonNegativeFloat = 3.46


class PolicySection(_Section):
    """``staleness`` is shared (matched comparisons); ``[policy.NAME]`` sets any parameter of one policy
    (``docs/scheduler.md``), e.g. ``stream_micro_steps`` for a baseline, or its own ``staleness``."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    staleness: NonNegativeInt = 0
    elastic: dict[str, Any] = {}
    colocate: dict[str, Any] = {}
    async_: dict[str, Any] = Field({}, alias="async")

    def values(self, policy: str) -> dict[str, Any]:
        """The scenario's parameters for ``policy``: the shared staleness (not colocate's), then its section."""
        out: dict[str, Any] = {} if policy == "colocate" else {"staleness": self.staleness}
        out.update({"elastic": self.elastic, "colocate": self.colocate, "async": self.async_}[policy])
        return out


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
    decode: DecodeSpec = DecodeSpec()
    calls: CallsSpec = CallsSpec()
    switch: SwitchSpec = SwitchSpec()
    policy: PolicySection = PolicySection()
    reward: RewardSpec = RewardSpec()
    targets: Targets = Targets()

    @model_validator(mode="after")
    def _consistent(self) -> "Scenario":
        from gyre.scheduler import POLICIES, VERSIONS

        for name, policy in POLICIES.items():
            # a section may hold a shipped older or newer version's parameters (elastic/3's, for
            # ``gyre sim --policy-version``); the version that runs validates them again (``policy_params``)
            shipped = [policy, *(p for p in VERSIONS.values() if p.name == name and p is not policy)]
            errors: list[ConfigError] = []
            for version in shipped:
                try:
                    params = version.params(self.policy.values(name))
                    break
                except ConfigError as error:
                    errors.append(error)
            else:
                raise ValueError(f"[policy.{name}]: {errors[0]}") from None
            if params.oversample_groups and not params.partial_rollouts:
                raise ValueError(f"policy.{name}.oversample_groups needs partial_rollouts = true")
            if params.oversample_groups > self.batch.groups:
                raise ValueError(f"policy.{name}.oversample_groups ({params.oversample_groups}) may be at most "
                                 f"a batch ({self.batch.groups} groups): a step must hold every group due")
            if name == "async" and params.training_cells >= self.cluster.cells:
                raise ValueError(f"policy.async.training_cells ({params.training_cells}) must leave at "
                                 f"least one of the {self.cluster.cells} cells for rollout")
        d = self.decode
        if d.share and not (d.step_ms or d.per_request_ms or d.per_mtoken_ms):
            raise ValueError("decode.share > 0 needs a decode step cost (step_ms, per_request_ms or per_mtoken_ms)")
        if self.calls.simulate and not d.share:
            raise ValueError("calls.simulate needs decode.share > 0: a call's output tokens are its share of the "
                             "execution's time at the decode curve's speed")
        if self.rollout.median_s > self.rollout.timeout_s:
            raise ValueError("rollout.median_s exceeds rollout.timeout_s")
        return self


def scenario_names() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A scenario by name (``seed-2.4t``) or path to a TOML file (any name), with errors that name the problem."""
    path = Path(name_or_path)
    if not path.is_file():
        path = SCENARIO_DIR / f"{name_or_path}.toml"
        if not path.exists() and Path(name_or_path).suffix == ".toml":
            raise ConfigError(f"scenario file {name_or_path} does not exist")
        if not path.exists():
            raise ConfigError(f"unknown scenario {str(name_or_path)!r}; known scenarios: "
                              f"{', '.join(scenario_names())} (or give the path of a scenario file)")
    try:
        data = tomllib.loads(path.read_text())
    except UnicodeDecodeError as error:
        raise ConfigError(f"scenario {path} is not a text file: {error}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"scenario {path} is not valid TOML: {error}") from error
    return parse_scenario(data, source=str(path))


def with_values(scenario: Scenario, values: dict[str, Any]) -> Scenario:
    data = json.loads(scenario.model_dump_json(by_alias=True))
    for dotted, value in values.items():
        *path, key = dotted.split(".")
        node = data
        for part in path:
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"scenario has no parameter {dotted!r}")
            node = node[part]
        if not isinstance(node, dict) or key not in node:
            raise ConfigError(f"scenario has no parameter {dotted!r}")
        node[key] = value
    return parse_scenario(data, source=f"{scenario.name} with {values}")


def with_policy_values(scenario: Scenario, values: dict[str, Any]) -> Scenario:
    """The scenario with policy parameters set: ``staleness`` (shared) or ``POLICY.FIELD`` (one policy)."""
    data = scenario.policy.model_dump(by_alias=True)
    for key, value in values.items():
        name, dot, field = key.partition(".")
        if not dot:
            if key != "staleness":
                raise ConfigError(f"policy parameter {key!r}: give POLICY.FIELD (e.g. colocate.stream_micro_steps) "
                                  "or staleness")
            data["staleness"] = value
        elif name not in ("elastic", "colocate", "async"):
            raise ConfigError(f"policy parameter {key!r}: unknown policy {name!r}; known: elastic, colocate, async")
        else:
            data[name] = {**data[name], field: value}
    whole = json.loads(scenario.model_dump_json(by_alias=True))
    whole["policy"] = data
    return parse_scenario(whole, source=f"{scenario.name} with {values}")


def parse_scenario(data: dict, source: str = "<scenario>") -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '<top>'}: {e['msg']}" for e in error.errors())
        raise ConfigError(f"scenario {source} is invalid: {problems}") from error
