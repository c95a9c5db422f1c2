from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventBatch(_message.Message):
    __slots__ = ("batch_id", "arrow_ipc", "wait")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    arrow_ipc: bytes
    wait: bool
    def __init__(self, batch_id: _Optional[int] = ..., arrow_ipc: _Optional[bytes] = ..., wait: _Optional[bool] = ...) -> None: ...

class EventAck(_message.Message):
    __slots__ = ("batch_id", "position", "durable", "error")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    position: int
    durable: bool
    error: str
    def __init__(self, batch_id: _Optional[int] = ..., position: _Optional[int] = ..., durable: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_us",)
    SENT_US_FIELD_NUMBER: _ClassVar[int]
    sent_us: int
    def __init__(self, sent_us: _Optional[int] = ...) -> None: ...

class CommandDone(_message.Message):
    __slots__ = ("command_id", "ok", "error", "figures", "detail", "retryable", "error_type")
    class FiguresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIGURES_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    RETRYABLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    ok: bool
    error: str
    figures: _containers.ScalarMap[str, float]
    detail: bytes
    retryable: bool
    error_type: str
    def __init__(self, command_id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., figures: _Optional[_Mapping[str, float]] = ..., detail: _Optional[bytes] = ..., retryable: _Optional[bool] = ..., error_type: _Optional[str] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("run_id", "held", "heartbeat_s")
    class HeldEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_S_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    held: _containers.ScalarMap[str, int]
    heartbeat_s: float
    def __init__(self, run_id: _Optional[str] = ..., held: _Optional[_Mapping[str, int]] = ..., heartbeat_s: _Optional[float] = ...) -> None: ...

class CellHello(_message.Message):
    __slots__ = ("cell_id", "slots", "is_core", "engine_url", "trainer_endpoint", "transfer_session", "incarnation", "producers")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    IS_CORE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SESSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PRODUCERS_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    slots: int
    is_core: bool
    engine_url: str
    trainer_endpoint: str
    transfer_session: str
    incarnation: str
    producers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cell_id: _Optional[str] = ..., slots: _Optional[int] = ..., is_core: _Optional[bool] = ..., engine_url: _Optional[str] = ..., trainer_endpoint: _Optional[str] = ..., transfer_session: _Optional[str] = ..., incarnation: _Optional[str] = ..., producers: _Optional[_Iterable[str]] = ...) -> None: ...

class CellUp(_message.Message):
    __slots__ = ("hello", "events", "heartbeat", "done", "ask")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ASK_FIELD_NUMBER: _ClassVar[int]
    hello: CellHello
    events: EventBatch
    heartbeat: Heartbeat
    done: CommandDone
    ask: WeightsAsk
    def __init__(self, hello: _Optional[_Union[CellHello, _Mapping]] = ..., events: _Optional[_Union[EventBatch, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., done: _Optional[_Union[CommandDone, _Mapping]] = ..., ask: _Optional[_Union[WeightsAsk, _Mapping]] = ...) -> None: ...

class WeightsRef(_message.Message):
    __slots__ = ("version", "location", "sha256", "peer_session", "manifest")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PEER_SESSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    version: int
    location: str
    sha256: str
    peer_session: str
    manifest: bytes
    def __init__(self, version: _Optional[int] = ..., location: _Optional[str] = ..., sha256: _Optional[str] = ..., peer_session: _Optional[str] = ..., manifest: _Optional[bytes] = ...) -> None: ...

class Serve(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Pause(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadWeights(_message.Message):
    __slots__ = ("weights",)
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    weights: WeightsRef
    def __init__(self, weights: _Optional[_Union[WeightsRef, _Mapping]] = ...) -> None: ...

class JoinStep(_message.Message):
    __slots__ = ("trainer_endpoint", "weights")
    TRAINER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    trainer_endpoint: str
    weights: WeightsRef
    def __init__(self, trainer_endpoint: _Optional[str] = ..., weights: _Optional[_Union[WeightsRef, _Mapping]] = ...) -> None: ...

class Train(_message.Message):
    __slots__ = ("step", "groups", "upto_seq")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    UPTO_SEQ_FIELD_NUMBER: _ClassVar[int]
    step: int
    groups: _containers.RepeatedScalarFieldContainer[str]
    upto_seq: int
    def __init__(self, step: _Optional[int] = ..., groups: _Optional[_Iterable[str]] = ..., upto_seq: _Optional[int] = ...) -> None: ...

class Leave(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ToTraining(_message.Message):
    __slots__ = ("pause_mode", "join")
    PAUSE_MODE_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    pause_mode: str
    join: JoinStep
    def __init__(self, pause_mode: _Optional[str] = ..., join: _Optional[_Union[JoinStep, _Mapping]] = ...) -> None: ...

class ToRollout(_message.Message):
    __slots__ = ("leave", "reason", "weights", "ask", "plan")
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ASK_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    leave: bool
    reason: str
    weights: WeightsRef
    ask: bool
    plan: WeightsAnswer
    def __init__(self, leave: _Optional[bool] = ..., reason: _Optional[str] = ..., weights: _Optional[_Union[WeightsRef, _Mapping]] = ..., ask: _Optional[bool] = ..., plan: _Optional[_Union[WeightsAnswer, _Mapping]] = ...) -> None: ...

class WeightsAsk(_message.Message):
    __slots__ = ("ask_id",)
    ASK_ID_FIELD_NUMBER: _ClassVar[int]
    ask_id: int
    def __init__(self, ask_id: _Optional[int] = ...) -> None: ...

class WeightsAnswer(_message.Message):
    __slots__ = ("ask_id", "load", "weights", "error", "command_id")
    ASK_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    ask_id: int
    load: bool
    weights: WeightsRef
    error: str
    command_id: int
    def __init__(self, ask_id: _Optional[int] = ..., load: _Optional[bool] = ..., weights: _Optional[_Union[WeightsRef, _Mapping]] = ..., error: _Optional[str] = ..., command_id: _Optional[int] = ...) -> None: ...

class Sync(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CellCommand(_message.Message):
    __slots__ = ("command_id", "serve", "pause", "release", "load_weights", "join_step", "train", "leave", "stop", "sync", "to_rollout", "to_training")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    SERVE_FIELD_NUMBER: _ClassVar[int]
    PAUSE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    LOAD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    JOIN_STEP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    TO_ROLLOUT_FIELD_NUMBER: _ClassVar[int]
    TO_TRAINING_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    serve: Serve
    pause: Pause
    release: Release
    load_weights: LoadWeights
    join_step: JoinStep
    train: Train
    leave: Leave
    stop: Stop
    sync: Sync
    to_rollout: ToRollout
    to_training: ToTraining
    def __init__(self, command_id: _Optional[int] = ..., serve: _Optional[_Union[Serve, _Mapping]] = ..., pause: _Optional[_Union[Pause, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., load_weights: _Optional[_Union[LoadWeights, _Mapping]] = ..., join_step: _Optional[_Union[JoinStep, _Mapping]] = ..., train: _Optional[_Union[Train, _Mapping]] = ..., leave: _Optional[_Union[Leave, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., sync: _Optional[_Union[Sync, _Mapping]] = ..., to_rollout: _Optional[_Union[ToRollout, _Mapping]] = ..., to_training: _Optional[_Union[ToTraining, _Mapping]] = ...) -> None: ...

class CellDown(_message.Message):
    __slots__ = ("welcome", "ack", "command", "weights")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    ack: EventAck
    command: CellCommand
    weights: WeightsAnswer
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., ack: _Optional[_Union[EventAck, _Mapping]] = ..., command: _Optional[_Union[CellCommand, _Mapping]] = ..., weights: _Optional[_Union[WeightsAnswer, _Mapping]] = ...) -> None: ...

class ProxyHello(_message.Message):
    __slots__ = ("proxy_id", "url", "incarnation", "producers", "lanes", "lane")
    PROXY_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PRODUCERS_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    proxy_id: str
    url: str
    incarnation: str
    producers: _containers.RepeatedScalarFieldContainer[str]
    lanes: _containers.RepeatedScalarFieldContainer[str]
    lane: str
    def __init__(self, proxy_id: _Optional[str] = ..., url: _Optional[str] = ..., incarnation: _Optional[str] = ..., producers: _Optional[_Iterable[str]] = ..., lanes: _Optional[_Iterable[str]] = ..., lane: _Optional[str] = ...) -> None: ...

class ProxyUp(_message.Message):
    __slots__ = ("hello", "events", "heartbeat", "done")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    hello: ProxyHello
    events: EventBatch
    heartbeat: Heartbeat
    done: CommandDone
    def __init__(self, hello: _Optional[_Union[ProxyHello, _Mapping]] = ..., events: _Optional[_Union[EventBatch, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., done: _Optional[_Union[CommandDone, _Mapping]] = ...) -> None: ...

class CellRoute(_message.Message):
    __slots__ = ("cell_id", "engine_url", "slots", "admitting", "weights_version")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    ADMITTING_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    engine_url: str
    slots: int
    admitting: bool
    weights_version: int
    def __init__(self, cell_id: _Optional[str] = ..., engine_url: _Optional[str] = ..., slots: _Optional[int] = ..., admitting: _Optional[bool] = ..., weights_version: _Optional[int] = ...) -> None: ...

class Routing(_message.Message):
    __slots__ = ("cells",)
    CELLS_FIELD_NUMBER: _ClassVar[int]
    cells: _containers.RepeatedCompositeFieldContainer[CellRoute]
    def __init__(self, cells: _Optional[_Iterable[_Union[CellRoute, _Mapping]]] = ...) -> None: ...

class CallRedirect(_message.Message):
    __slots__ = ("call_id", "execution_id", "to_cell_id")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    TO_CELL_ID_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    execution_id: str
    to_cell_id: str
    def __init__(self, call_id: _Optional[str] = ..., execution_id: _Optional[str] = ..., to_cell_id: _Optional[str] = ...) -> None: ...

class RedirectCell(_message.Message):
    __slots__ = ("from_cell_id", "calls", "cut", "resume_version")
    FROM_CELL_ID_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    RESUME_VERSION_FIELD_NUMBER: _ClassVar[int]
    from_cell_id: str
    calls: _containers.RepeatedCompositeFieldContainer[CallRedirect]
    cut: bool
    resume_version: int
    def __init__(self, from_cell_id: _Optional[str] = ..., calls: _Optional[_Iterable[_Union[CallRedirect, _Mapping]]] = ..., cut: _Optional[bool] = ..., resume_version: _Optional[int] = ...) -> None: ...

class RedirectCells(_message.Message):
    __slots__ = ("cells",)
    CELLS_FIELD_NUMBER: _ClassVar[int]
    cells: _containers.RepeatedCompositeFieldContainer[RedirectCell]
    def __init__(self, cells: _Optional[_Iterable[_Union[RedirectCell, _Mapping]]] = ...) -> None: ...

class ExecutionSpec(_message.Message):
    __slots__ = ("execution_id", "group_id", "task_id", "step", "policy_version", "attempt", "token")
    EXECUTION_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    execution_id: str
    group_id: str
    task_id: str
    step: int
    policy_version: int
    attempt: int
    token: str
    def __init__(self, execution_id: _Optional[str] = ..., group_id: _Optional[str] = ..., task_id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., attempt: _Optional[int] = ..., token: _Optional[str] = ...) -> None: ...

class QueueExecutions(_message.Message):
    __slots__ = ("executions",)
    EXECUTIONS_FIELD_NUMBER: _ClassVar[int]
    executions: _containers.RepeatedCompositeFieldContainer[ExecutionSpec]
    def __init__(self, executions: _Optional[_Iterable[_Union[ExecutionSpec, _Mapping]]] = ...) -> None: ...

class ProxyCommand(_message.Message):
    __slots__ = ("command_id", "routing", "redirect", "queue", "stop", "sync", "redirects")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    REDIRECTS_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    routing: Routing
    redirect: RedirectCell
    queue: QueueExecutions
    stop: Stop
    sync: Sync
    redirects: RedirectCells
    def __init__(self, command_id: _Optional[int] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ..., redirect: _Optional[_Union[RedirectCell, _Mapping]] = ..., queue: _Optional[_Union[QueueExecutions, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., sync: _Optional[_Union[Sync, _Mapping]] = ..., redirects: _Optional[_Union[RedirectCells, _Mapping]] = ...) -> None: ...

class ProxyDown(_message.Message):
    __slots__ = ("welcome", "ack", "command")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    ack: EventAck
    command: ProxyCommand
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., ack: _Optional[_Union[EventAck, _Mapping]] = ..., command: _Optional[_Union[ProxyCommand, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CellStatus(_message.Message):
    __slots__ = ("cell_id", "role", "switching_to", "connected", "is_core", "slots", "load", "last_heartbeat_age_s")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SWITCHING_TO_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    IS_CORE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    role: str
    switching_to: str
    connected: bool
    is_core: bool
    slots: int
    load: int
    last_heartbeat_age_s: float
    def __init__(self, cell_id: _Optional[str] = ..., role: _Optional[str] = ..., switching_to: _Optional[str] = ..., connected: _Optional[bool] = ..., is_core: _Optional[bool] = ..., slots: _Optional[int] = ..., load: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("run_id", "folded_seq", "watermark", "policy_version", "steps_trained", "cells", "proxy_connected", "policy")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FOLDED_SEQ_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    CELLS_FIELD_NUMBER: _ClassVar[int]
    PROXY_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    folded_seq: int
    watermark: int
    policy_version: int
    steps_trained: int
    cells: _containers.RepeatedCompositeFieldContainer[CellStatus]
    proxy_connected: bool
    policy: str
    def __init__(self, run_id: _Optional[str] = ..., folded_seq: _Optional[int] = ..., watermark: _Optional[int] = ..., policy_version: _Optional[int] = ..., steps_trained: _Optional[int] = ..., cells: _Optional[_Iterable[_Union[CellStatus, _Mapping]]] = ..., proxy_connected: _Optional[bool] = ..., policy: _Optional[str] = ...) -> None: ...

class LogRead(_message.Message):
    __slots__ = ("from_seq", "to_seq", "follow")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    TO_SEQ_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    to_seq: int
    follow: bool
    def __init__(self, from_seq: _Optional[int] = ..., to_seq: _Optional[int] = ..., follow: _Optional[bool] = ...) -> None: ...

class LogChunk(_message.Message):
    __slots__ = ("ipc",)
    IPC_FIELD_NUMBER: _ClassVar[int]
    ipc: bytes
    def __init__(self, ipc: _Optional[bytes] = ...) -> None: ...

class TrainerJoin(_message.Message):
    __slots__ = ("cell_id", "transfer_session", "transfer_s")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SESSION_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    transfer_session: str
    transfer_s: float
    def __init__(self, cell_id: _Optional[str] = ..., transfer_session: _Optional[str] = ..., transfer_s: _Optional[float] = ...) -> None: ...

class TrainerJoined(_message.Message):
    __slots__ = ("step", "weights", "gradient_slot", "lease_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_SLOT_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    weights: WeightsRef
    gradient_slot: bytes
    lease_s: float
    def __init__(self, step: _Optional[int] = ..., weights: _Optional[_Union[WeightsRef, _Mapping]] = ..., gradient_slot: _Optional[bytes] = ..., lease_s: _Optional[float] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("cell_id", "policy_version")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    policy_version: int
    def __init__(self, cell_id: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class ClaimReply(_message.Message):
    __slots__ = ("status", "step", "micro_step", "batch", "weights")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEP_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    status: str
    step: int
    micro_step: int
    batch: bytes
    weights: WeightsRef
    def __init__(self, status: _Optional[str] = ..., step: _Optional[int] = ..., micro_step: _Optional[int] = ..., batch: _Optional[bytes] = ..., weights: _Optional[_Union[WeightsRef, _Mapping]] = ...) -> None: ...

class MicroStepDone(_message.Message):
    __slots__ = ("cell_id", "step", "micro_step", "result")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEP_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    step: int
    micro_step: int
    result: bytes
    def __init__(self, cell_id: _Optional[str] = ..., step: _Optional[int] = ..., micro_step: _Optional[int] = ..., result: _Optional[bytes] = ...) -> None: ...

class GradientsWritten(_message.Message):
    __slots__ = ("cell_id", "step", "micro_steps")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MICRO_STEPS_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    step: int
    micro_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cell_id: _Optional[str] = ..., step: _Optional[int] = ..., micro_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class TrainerLeave(_message.Message):
    __slots__ = ("cell_id", "reason")
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    reason: str
    def __init__(self, cell_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class TrainerAck(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class TrainerHeartbeat(_message.Message):
    __slots__ = ("cell_id",)
    CELL_ID_FIELD_NUMBER: _ClassVar[int]
    cell_id: str
    def __init__(self, cell_id: _Optional[str] = ...) -> None: ...
