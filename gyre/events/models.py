"""The event vocabulary: one frozen pydantic model per kind, shared by every part of Gyre.

An event has envelope fields (the ids that locate it) and payload fields (what happened). The log writer
assigns ``seq`` and, when the producer leaves it empty, ``ts``. A kind declares which envelope ids it
requires by narrowing their type (``execution_id: str``); the rest stay optional.

Evolution is additive: new kinds and new optional fields only. Renaming or retyping a field is a new kind.
"""

from typing import Any, ClassVar, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, model_validator

from gyre.events.fields import (
    BranchKind,
    EvaluationFailure,
    ExecutionStatus,
    FinishReason,
    LogProbs,
    Role,
    RunStatus,
    TokenIds,
)

ENVELOPE_FIELDS: tuple[str, ...] = (
    "seq", "ts", "run_id", "execution_id", "call_id", "cell_id", "step", "producer", "producer_seq")
"""Envelope columns besides ``kind``, in storage order."""

EVENT_TYPES: dict[str, type["Event"]] = {}
"""Every kind, in definition order (which is also the order of the struct columns in the Arrow schema)."""


class Event(BaseModel):
    """Base of every event. Subclasses set ``kind`` and ``view`` and add payload fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=False)

    kind: ClassVar[str]
    view: ClassVar[str]
    """Name of the DuckDB view that shows this kind with its payload flattened into columns."""

    seq: NonNegativeInt | None = None
    ts: AwareDatetime | None = None
    run_id: str | None = None
    execution_id: str | None = None
    call_id: str | None = None
    cell_id: str | None = None
    step: NonNegativeInt | None = None
    producer: str | None = None
    """Who handed the event to the log writer (a proxy, a harness runner, a trainer, the controller)."""
    producer_seq: NonNegativeInt | None = None
    """The producer's own gapless count of its events: the writer drops what it already holds (exactly once)."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is None:
            return
        if kind in EVENT_TYPES:
            raise TypeError(f"event kind {kind!r} is defined twice")
        EVENT_TYPES[kind] = cls

    @classmethod
    def payload_fields(cls) -> tuple[str, ...]:
        return tuple(name for name in cls.model_fields if name not in ENVELOPE_FIELDS)

    def payload(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.payload_fields()}


# --- run lifecycle -----------------------------------------------------------------------------------


class Redirect(BaseModel):
    """Where one in-flight call goes when its cell leaves rollout."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    call_id: str
    execution_id: str
    to_cell_id: str


class RunStarted(Event):
    kind: ClassVar[str] = "run_started"
    view: ClassVar[str] = "runs_started"
    run_id: str
    name: str
    policy: str = Field(description="scheduler policy name: elastic | colocate | async")
    policy_version: str = Field(description="version of the policy code, so replay can refuse a mismatch")
    policy_params: str = Field("{}", description="policy parameters as JSON")
    config: str = Field("{}", description="the whole run configuration as JSON")
    seed: int | None = None
    gyre_version: str = ""
    decision_points: Literal["instant", "explicit"] = Field(
        "instant", description="instant: a policy decides once per timestamp (the simulator's clock); explicit: "
                               "each decision names the log prefix it was decided on (decided_at_seq)")


class RunFinished(Event):
    kind: ClassVar[str] = "run_finished"
    view: ClassVar[str] = "runs_finished"
    run_id: str
    status: RunStatus
    message: str = ""


class RunResumed(Event):
    """A cluster run's controller started again (`gyre run --resume`) over the log its predecessor wrote."""
    kind: ClassVar[str] = "run_resumed"
    view: ClassVar[str] = "runs_resumed"
    run_id: str
    folded_seq: int = Field(description="the last seq the new controller folded before it acted")
    adopted: str = Field("", description="processes found running and taken over (comma-separated)")
    started: str = Field("", description="processes found gone and started again (comma-separated)")


# --- cells and roles ------------------------------------------------------------------------------------


class CellRegistered(Event):
    kind: ClassVar[str] = "cell_registered"
    view: ClassVar[str] = "cells"
    cell_id: str
    role: Role
    is_core: bool = False
    gpus: NonNegativeInt = 0
    slots: NonNegativeInt = Field(description="concurrent executions the cell serves in rollout")
    address: str | None = None
    incarnation: str | None = Field(default=None, description="the cell process's start id (cluster runs): a "
                                    "restarted controller tells a reconnecting process from a restarted one")
    trainer_endpoint: str | None = Field(None, description="the cell's Trainer service (a cluster's core: "
                                         "satellites join its steps there)")


class CellLost(Event):
    kind: ClassVar[str] = "cell_lost"
    view: ClassVar[str] = "cells_lost"
    cell_id: str
    reason: str = ""


class RoleSwitchRequested(Event):
    kind: ClassVar[str] = "role_switch_requested"
    view: ClassVar[str] = "role_switch_requests"
    cell_id: str
    from_role: Role
    to_role: Role
    reason: str = ""
    watermark: NonNegativeInt | None = Field(None, description="running + queued executions at decision time")
    redirects: list[Redirect] = Field(default_factory=list)
    decided_at_seq: NonNegativeInt | None = Field(
        None, description="seq of the last event of the log prefix the policy decided on (live runs)")


class RoleSwitchCompleted(Event):
    kind: ClassVar[str] = "role_switch_completed"
    view: ClassVar[str] = "role_switches"
    cell_id: str
    from_role: Role
    to_role: Role
    duration_s: NonNegativeFloat
    drain_s: NonNegativeFloat | None = Field(None, description="waiting for the cell's executions to leave it")
    redirected_calls: NonNegativeInt | None = Field(None, description="in-flight calls moved to other cells")
    redirect_s: NonNegativeFloat | None = None
    engine_pause_s: NonNegativeFloat | None = Field(None, description="pausing and releasing the engine")
    weights_bytes: NonNegativeInt | None = Field(None, description="weights moved into the engine on return")
    weights_s: NonNegativeFloat | None = None
    engine_resume_s: NonNegativeFloat | None = None
    trainer_join_s: NonNegativeFloat | None = Field(None, description="the trainer taking the cell over")


# --- executions ------------------------------------------------------------------------------------------


class ExecutionQueued(Event):
    kind: ClassVar[str] = "execution_queued"
    view: ClassVar[str] = "executions_queued"
    execution_id: str
    task_id: str
    group_id: str = Field(description="GSPO group: the executions of one task sampled together")
    policy_version: NonNegativeInt = 0
    attempt: NonNegativeInt = 0


class ExecutionStarted(Event):
    kind: ClassVar[str] = "execution_started"
    view: ClassVar[str] = "executions_started"
    execution_id: str
    cell_id: str | None = None
    workspace: str | None = None
    pid: int | None = None


class ExecutionFinished(Event):
    kind: ClassVar[str] = "execution_finished"
    view: ClassVar[str] = "executions_finished"
    execution_id: str
    status: ExecutionStatus
    duration_s: NonNegativeFloat
    exit_code: int | None = None
    message: str = ""
    tokens: NonNegativeInt | None = Field(
        None, description="trajectory tokens of the execution, from producers whose calls carry no token ids "
                          "(the simulator); None when the model calls hold the ids")


# --- model calls -----------------------------------------------------------------------------------------


class ModelCallStarted(Event):
    kind: ClassVar[str] = "model_call_started"
    view: ClassVar[str] = "model_calls_started"
    execution_id: str
    call_id: str
    cell_id: str
    parent_call_id: str | None = None
    branch: BranchKind = "main"
    prompt_tokens: NonNegativeInt = 0
    policy_version: NonNegativeInt = 0
    rerendered_turns: NonNegativeInt = 0
    """Earlier assistant turns the chat template renders differently now from what the model wrote (Qwen3
    drops earlier `<think>`): their recorded output is not reused, so the call is a new root or drifts."""
    attempt: NonNegativeInt = Field(0, description="the execution's attempt the call belongs to")
    dropped_tools: list[str] = Field(default_factory=list)
    """Tools the request offered that the prompt leaves out: hosted tools the policy cannot call (Responses
    `web_search`, ...; an MCP server as `mcp:<label>`). The harness offered them; the model never saw them."""


class ModelCallFinished(Event):
    """One model call, token-in/token-out.

    Its full sequence is the first ``prefix_len`` tokens of the parent's full sequence (prompt + output),
    then ``prompt_delta_ids`` (context: never trained), then ``output_ids`` (sampled by the policy, with
    their behaviour log-probabilities). A call without a parent is a root and has ``prefix_len == 0``.
    """

    kind: ClassVar[str] = "model_call_finished"
    view: ClassVar[str] = "model_calls"
    execution_id: str
    call_id: str
    cell_id: str
    parent_call_id: str | None = None
    branch: BranchKind = "main"
    prefix_len: NonNegativeInt = 0
    prompt_delta_ids: TokenIds = Field(default_factory=list)
    output_ids: TokenIds = Field(default_factory=list)
    output_logprobs: LogProbs = Field(default_factory=list)
    policy_version: NonNegativeInt = 0
    engine_version: NonNegativeInt | None = Field(
        None, description="the weights version the engine reported serving the call with (the oldest, if it "
                          "moved between engines); None when the engine reported none, or when the call ended "
                          "before any engine produced a token (policy_version then holds the version the "
                          "execution was queued with)")
    cached_tokens: NonNegativeInt = 0
    latency_s: NonNegativeFloat = 0.0
    finish_reason: FinishReason = "stop"
    drift_tokens: NonNegativeInt = Field(0, description="rendered prefix tokens that differed from the record")
    attempt: NonNegativeInt = Field(0, description="the execution's attempt the call belongs to: only the last "
                                                   "attempt of an execution is trained")

    @model_validator(mode="after")
    def _tokens_line_up(self) -> "ModelCallFinished":
        if len(self.output_ids) != len(self.output_logprobs):
            raise ValueError(
                f"output_logprobs has {len(self.output_logprobs)} entries for "
                f"{len(self.output_ids)} output_ids; they must match one to one"
            )
        if self.parent_call_id is None and self.prefix_len:
            raise ValueError(f"prefix_len is {self.prefix_len} but the call has no parent_call_id")
        return self


class CallRedirected(Event):
    kind: ClassVar[str] = "call_redirected"
    view: ClassVar[str] = "call_redirects"
    execution_id: str
    call_id: str
    from_cell_id: str
    to_cell_id: str
    kv_blocks: NonNegativeInt = Field(0, description="KV pages moved engine to engine")
    kv_bytes: NonNegativeInt = 0
    tokens_done: NonNegativeInt = Field(0, description="output tokens already generated when redirected")
    kv_tokens: NonNegativeInt = Field(0, description="prefix tokens whose KV moved engine to engine")
    kv_transfer_seconds: NonNegativeFloat = Field(0.0, description="time the bytes took to move")
    kv_seconds: NonNegativeFloat = Field(0.0, description="the whole move: reserve, transfer, commit")
    tokens_recomputed: NonNegativeInt = Field(0, description="prompt tokens the new engine computes again")
    kv_refused: str | None = Field(None, description="why no KV moved when a mover refused (version, layout)")


# --- evaluation --------------------------------------------------------------------------------------------


class RewardRecorded(Event):
    kind: ClassVar[str] = "reward_recorded"
    view: ClassVar[str] = "rewards"
    execution_id: str
    reward: float = Field(ge=0.0, le=1.0)
    evaluator: str = ""
    partial: bool = Field(False, description="scored on the workspace of a timed-out execution")
    details: str = Field("{}", description="evaluator details as JSON")
    duration_s: NonNegativeFloat = 0.0


class EvaluationFailed(Event):
    """The evaluator itself failed: the execution is excluded, never scored 0."""

    kind: ClassVar[str] = "evaluation_failed"
    view: ClassVar[str] = "evaluation_failures"
    execution_id: str
    error: EvaluationFailure
    evaluator: str = ""
    message: str = ""


# --- training ----------------------------------------------------------------------------------------------


class TrainStepStarted(Event):
    kind: ClassVar[str] = "train_step_started"
    view: ClassVar[str] = "train_steps_started"
    step: NonNegativeInt
    policy_version: NonNegativeInt
    planned_micro_steps: NonNegativeInt
    groups: NonNegativeInt = 0
    trajectories: NonNegativeInt = 0


class MicroStepClaimed(Event):
    kind: ClassVar[str] = "micro_step_claimed"
    view: ClassVar[str] = "micro_step_claims"
    step: NonNegativeInt
    cell_id: str
    micro_step: NonNegativeInt
    tokens: NonNegativeInt = 0


class MicroStepFinished(Event):
    kind: ClassVar[str] = "micro_step_finished"
    view: ClassVar[str] = "micro_steps"
    step: NonNegativeInt
    cell_id: str
    micro_step: NonNegativeInt
    tokens: NonNegativeInt = 0
    loss: float | None = None
    duration_s: NonNegativeFloat = 0.0
    tokens_trained: NonNegativeInt | None = Field(None, description="policy tokens the loss was taken over")


class MicroStepReleased(Event):
    """A satellite's micro-step taken back before its gradients reached the core (its lease ran out, it left,
    or the controller lost its cell): it is claimable again, and whatever the satellite did for it is dropped."""

    kind: ClassVar[str] = "micro_step_released"
    view: ClassVar[str] = "micro_steps_released"
    step: NonNegativeInt
    cell_id: str
    micro_step: NonNegativeInt
    reason: str = ""


class TrainStepFinished(Event):
    kind: ClassVar[str] = "train_step_finished"
    view: ClassVar[str] = "train_steps"
    step: NonNegativeInt
    policy_version: NonNegativeInt = Field(description="the version the step produced")
    micro_steps: NonNegativeInt
    samples: NonNegativeInt = Field(0, description="executions whose data the step consumed")
    tokens: NonNegativeInt = Field(0, description="tokens forwarded through the model (packed: shared prefixes "
                                                  "once, padding not counted)")
    loss: float | None = None
    grad_norm: float | None = None
    duration_s: NonNegativeFloat = 0.0
    # -- metrics (all optional: producers fill what they measure; older logs have none) --
    tokens_trained: NonNegativeInt | None = Field(None, description="policy tokens the loss was taken over")
    tokens_padded: NonNegativeInt | None = Field(None, description="forwarded tokens including the padding "
                                                                   "of each forward pass")
    tokens_per_s: NonNegativeFloat | None = Field(None, description="forwarded tokens per second of "
                                                                    "forward-backward")
    clip_fraction: float | None = Field(None, description="token weight share whose GSPO clip was active")
    tis_truncated_fraction: float | None = Field(None, description="token weight share whose importance "
                                                                   "weight the TIS cap truncated")
    log_ratio_mean: NonNegativeFloat | None = Field(None, description="mean |log pi_trainer - log pi_engine| "
                                                                      "per trained token")
    log_ratio_max: NonNegativeFloat | None = Field(None, description="max |log pi_trainer - log pi_engine|")
    kl: float | None = Field(None, description="KL(engine || trainer) per token, k3 estimate")
    entropy: float | None = Field(None, description="policy entropy per token, estimated from the "
                                                    "sampled tokens (mean -log pi_trainer)")
    response_tokens_mean: NonNegativeFloat | None = Field(None, description="policy tokens per used execution")
    response_tokens_max: NonNegativeInt | None = None
    reward_mean: float | None = Field(None, description="mean reward of the executions the step used")
    reward_std: NonNegativeFloat | None = Field(None, description="std of the rewards the step used")
    group_reward_std: NonNegativeFloat | None = Field(None, description="mean within-group reward std")
    groups_zero_variance: NonNegativeInt | None = Field(None, description="groups whose rewards were all "
                                                                          "equal (zero advantage)")
    advantage_mean: float | None = None
    advantage_std: NonNegativeFloat | None = None
    advantage_min: float | None = None
    advantage_max: float | None = None
    rollout_s: NonNegativeFloat | None = Field(None, description="phase: rollouts of the step's groups")
    batch_s: NonNegativeFloat | None = Field(None, description="phase: building the batches from the log")
    forward_backward_s: NonNegativeFloat | None = Field(None, description="phase: sum of the micro-steps")
    optimizer_s: NonNegativeFloat | None = Field(None, description="phase: the optimizer step")


class TrainStepAborted(Event):
    """A train step that was open when its trainer died: it produced nothing and is trained again."""

    kind: ClassVar[str] = "train_step_aborted"
    view: ClassVar[str] = "train_steps_aborted"
    step: NonNegativeInt
    reason: str = ""


class WeightsPublished(Event):
    kind: ClassVar[str] = "weights_published"
    view: ClassVar[str] = "weights_published"
    policy_version: NonNegativeInt
    tensors: NonNegativeInt = 0
    bytes: NonNegativeInt = 0
    location: str = Field("", description="the weights file, relative to the run directory")
    duration_s: NonNegativeFloat = 0.0
    sha256: str = Field("", description="checksum of the weights file")


class EmulationReported(Event):
    """What a cell's emulated accelerator (`gyre.emulate`) held so far, cumulative for its incarnation: the
    emulated seconds of its work (scenario time), the wall seconds it computed and waited, and the wall
    seconds real compute overran its emulated time (the run's figures are valid only while that is small)."""

    kind: ClassVar[str] = "emulation_reported"
    view: ClassVar[str] = "emulation_reports"
    cell_id: str
    incarnation: str
    holds: NonNegativeInt
    emulated_s: NonNegativeFloat
    real_s: NonNegativeFloat
    waited_s: NonNegativeFloat
    overrun_s: NonNegativeFloat
    overruns: NonNegativeInt


class WeightsLoaded(Event):
    """A cell's engine now serves ``policy_version`` (a cluster run): loaded when it was brought up, when it
    returned to rollout, or because a version was published while it served. Until this event a cell admits
    no execution queued with a newer version; calls in flight finished on the old weights first
    (``drain_s``)."""

    kind: ClassVar[str] = "weights_loaded"
    view: ClassVar[str] = "weights_loaded"
    cell_id: str
    policy_version: NonNegativeInt
    cause: Literal["publish", "bring_up", "return_to_rollout", "resume"]
    duration_s: NonNegativeFloat = Field(0.0, description="from the command sent to the engine serving the version")
    drain_s: NonNegativeFloat = Field(0.0, description="waiting for the calls in flight to finish on the old weights")
    weights_bytes: NonNegativeInt = 0


class CheckpointSaved(Event):
    """Optimizer and trainer state after a step, durable under the run directory (resume starts here)."""

    kind: ClassVar[str] = "checkpoint_saved"
    view: ClassVar[str] = "checkpoints"
    step: NonNegativeInt
    policy_version: NonNegativeInt
    covers_seq: NonNegativeInt = Field(description="the log prefix the checkpointed state is the fold of")
    location: str = Field(description="the checkpoint directory, relative to the run directory")
    weights: str = Field(description="the weights file of policy_version, relative to the run directory")
    sha256: str = Field("", description="checksum of the optimizer state file")


class SatelliteJoined(Event):
    kind: ClassVar[str] = "satellite_joined"
    view: ClassVar[str] = "satellites_joined"
    cell_id: str
    step: NonNegativeInt
    policy_version: NonNegativeInt
    transfer_s: NonNegativeFloat = 0.0


class SatelliteLeft(Event):
    kind: ClassVar[str] = "satellite_left"
    view: ClassVar[str] = "satellites_left"
    cell_id: str
    step: NonNegativeInt | None = None
    reason: str = ""


# --- held-out evaluation -----------------------------------------------------------------------------------


class HeldOutEvaluated(Event):
    """The current policy ran a held-out task set (never trained on): its pass rate and mean reward."""

    kind: ClassVar[str] = "heldout_evaluated"
    view: ClassVar[str] = "heldout_evaluations"
    step: NonNegativeInt = Field(description="the train steps done before it (0: the initial policy)")
    policy_version: NonNegativeInt
    tasks: NonNegativeInt
    executions: NonNegativeInt
    scored: NonNegativeInt = Field(description="executions the evaluators scored (failures are excluded)")
    passed: NonNegativeInt = Field(description="scored executions whose reward reached pass_threshold")
    pass_threshold: float
    pass_rate: float | None = Field(None, description="passed / scored; None when nothing was scored")
    reward_mean: float | None = None
    duration_s: NonNegativeFloat = 0.0
    group_prefix: str = Field("", description="group_id prefix of its executions, to tell them from training")


# --- the control plane ---------------------------------------------------------------------------------


class CommandAbandoned(Event):
    """The controller gave up on a command after transient failures (`gyre.cluster.failures`): its target or
    the core was lost or replaced, the run was stopping, or its attempts ran out (the target is then declared
    lost). With ``switch_to``, the role switch it served ends here: the cell stays in its role."""

    kind: ClassVar[str] = "command_abandoned"
    view: ClassVar[str] = "commands_abandoned"
    command: str = Field(description="the command kind (join_step, train, redirect, ...)")
    target: Literal["cell", "proxy"] = "cell"
    reason: str = ""
    attempts: NonNegativeInt = 1
    incarnation: str | None = Field(None, description="the target cell's incarnation the command was sent to")
    switch_to: Role | None = Field(None, description="the role of the switch it ends (None: no switch ends)")


def event_type(kind: str) -> type[Event]:
    """The model class of a kind, or a clear error naming the known kinds."""
    from gyre.errors import UnknownEventKindError

    try:
        return EVENT_TYPES[kind]
    except KeyError:
        raise UnknownEventKindError(
            f"unknown event kind {kind!r}; known kinds: {', '.join(EVENT_TYPES)}"
        ) from None
