"""The failed-command rule (`gyre.cluster.failures`): what is transient, what is fatal, what each command kind
may do, and how `RemoteCell` and `Commands` act on it — over a fake hub, with no sleeps (the backoff's wait
is a function the test supplies)."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import Any

import grpc
import pytest

from gyre.cluster.actuator import Commands, RemoteCell, Transfers
from gyre.cluster.errors import PeerLost, Unavailable
from gyre.cluster.failures import (
    CELL_RULES,
    PROXY_RULES,
    Abandoned,
    Backoff,
    CommandFailed,
    Rule,
    failed_done,
    is_transient,
    perform,
)
from gyre.cluster.proto import gyre_pb2, gyre_pb2_grpc
from gyre.engine.errors import EngineHTTPError, EngineRequestError, EngineTimeoutError, EngineUnreachableError
from gyre.errors import ConfigError, LogCorruptionError, TransferError
from gyre.events import encode
from gyre.events.models import (
    CellLost,
    CellRegistered,
    CommandAbandoned,
    Event,
    RoleSwitchCompleted,
    RoleSwitchRequested,
    WeightsLoaded,
    WeightsPublished,
)
from gyre.run.live import LiveRun
from gyre.scheduler import SchedulerFold
from gyre.state.cluster import ClusterView
from gyre.state.fold import fold_batches
from gyre.trainer.errors import CheckpointError, TrainerError
from gyre.trainer.weights import WeightsError


class RpcError(grpc.RpcError):
    """What a gRPC stub raises: an error with a status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        super().__init__(f"<_InactiveRpcError of RPC that terminated with:\n\tstatus = {code}\n\tdetails = {details}>")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


NOT_READY = RpcError(grpc.StatusCode.UNAVAILABLE, "the core's trainer is not ready yet")


def _wrapped(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


# -- classification ------------------------------------------------------------------------------------------

TRANSIENT = [
    NOT_READY,
    RpcError(grpc.StatusCode.DEADLINE_EXCEEDED),
    RpcError(grpc.StatusCode.ABORTED),
    RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED),
    ConnectionResetError("peer reset"),
    TimeoutError("no answer"),
    EngineUnreachableError("http://e", "refused"),
    EngineTimeoutError("http://e", 5.0),
    TransferError("the peer's session is gone"),
    Unavailable("the core is restoring"),
    _wrapped(TrainerError("satellite c1 failed"), NOT_READY),  # a satellite whose core went away
]
FATAL = [
    RpcError(grpc.StatusCode.FAILED_PRECONDITION, "lease released"),
    RpcError(grpc.StatusCode.INVALID_ARGUMENT),
    RpcError(grpc.StatusCode.UNAUTHENTICATED),
    ConfigError("[cluster] trainer = 'megatron' needs CUDA"),
    CheckpointError("corrupt checkpoint"),
    WeightsError("checkpoint does not match the checksum in the log"),
    LogCorruptionError("seg", 0, "bad crc"),
    ValueError("cell c1 does not know command 'dance'"),
    EngineRequestError("sampling.top_p", "out of range"),
    EngineHTTPError("http://e", 500, "boom"),
    RuntimeError("a bug"),
    KeyError("x"),
    _wrapped(ValueError("bad batch"), ConnectionError("fatal types win over a wrapped cause")),
]


@pytest.mark.parametrize("error", TRANSIENT, ids=lambda e: f"{type(e).__name__}")
def test_transient_failures(error: BaseException) -> None:
    assert is_transient(error)
    done = failed_done(7, error)
    assert (done.ok, done.retryable, done.error_type, done.command_id) == (False, True, type(error).__name__, 7)


@pytest.mark.parametrize("error", FATAL, ids=lambda e: f"{type(e).__name__}")
def test_fatal_failures(error: BaseException) -> None:
    assert not is_transient(error)
    assert not failed_done(7, error).retryable


def _kinds(message: type) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.oneofs_by_name["body"].fields}


@pytest.mark.parametrize(("message", "rules"), [(gyre_pb2.CellCommand, CELL_RULES),
                                                (gyre_pb2.ProxyCommand, PROXY_RULES)])
def test_every_command_kind_has_a_rule(message: type, rules: dict[str, Rule]) -> None:
    """A command kind added to schemas/gyre.proto must say whether it may be sent again."""
    assert set(rules) == _kinds(message)
    never_twice = {"train", "queue", "stop"}  # a step trained twice, executions queued twice, a stop
    assert {k for k, rule in rules.items() if rule is Rule.ONCE} == never_twice & set(rules)


def test_a_process_reports_the_class_of_a_failure(cluster) -> None:
    """The link turns a handler's exception into ``retryable`` by its type."""
    def handler(command: gyre_pb2.CellCommand) -> None:
        raise NOT_READY if command.WhichOneof("body") == "join_step" else ValueError("no such weights")

    cluster.link("c0", handler=handler)
    joined = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(join_step=gyre_pb2.JoinStep())).result(5)
    loaded = cluster.hub.command_cell("c0", gyre_pb2.CellCommand(load_weights=gyre_pb2.LoadWeights())).result(5)
    assert (joined.ok, joined.retryable, joined.error_type) == (False, True, "RpcError")
    assert (loaded.ok, loaded.retryable, loaded.error_type) == (False, False, "ValueError")


# -- perform: the rule itself ----------------------------------------------------------------------------------


def _sends(*outcomes: gyre_pb2.CommandDone | BaseException):
    """A send that plays ``outcomes`` in turn (a failed CommandDone raises CommandFailed, as wait_done does)."""
    queue = list(outcomes)
    count = [0]

    def send() -> gyre_pb2.CommandDone:
        count[0] += 1
        outcome = queue.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        if not outcome.ok:
            raise CommandFailed("join step on cell c1", outcome)
        return outcome
    return send, count


OK = gyre_pb2.CommandDone(ok=True)


def test_transient_failures_are_sent_again_with_bounded_backoff() -> None:
    send, count = _sends(failed_done(1, NOT_READY), failed_done(2, NOT_READY), failed_done(3, NOT_READY), OK)
    waits: list[float] = []
    done = perform(send, "join", command="join_step", rule=Rule.RETRY, obsolete=lambda: None,
                   wait=lambda s: waits.append(s) or False, backoff=Backoff(attempts=5, first_s=0.5, cap_s=1.5))
    assert done is OK and count[0] == 4 and waits == [0.5, 1.0, 1.5]


def test_a_fatal_failure_is_raised_at_once_as_one_line() -> None:
    error = RpcError(grpc.StatusCode.INVALID_ARGUMENT, "the batch does not fit")
    send, count = _sends(failed_done(1, error))
    with pytest.raises(CommandFailed) as raised:
        perform(send, "join", command="join_step", rule=Rule.RETRY, obsolete=lambda: None, wait=lambda s: False)
    assert count[0] == 1
    assert str(raised.value).startswith("join step on cell c1 failed (fatal): RpcError: <_InactiveRpcError")
    assert "\n" not in str(raised.value) and "the batch does not fit" in str(raised.value)


@pytest.mark.parametrize(("rule", "obsolete", "stopping", "attempts", "stale", "why"), [
    (Rule.RETRY, None, False, 3, False, "no more attempts: retry"),
    (Rule.ONCE, None, False, 1, False, "no more attempts: once"),
    (Rule.RETRY, "cell c1 incarnation a was lost or replaced", False, 1, True, "was lost or replaced"),
    (Rule.RETRY, None, True, 1, True, "the run is stopping"),
])
def test_a_transient_failure_is_abandoned(rule, obsolete, stopping, attempts, stale, why) -> None:
    send, count = _sends(*[failed_done(i, NOT_READY) for i in range(5)])
    with pytest.raises(Abandoned) as raised:
        perform(send, "join", command="join_step", rule=rule, obsolete=lambda: obsolete, wait=lambda s: stopping,
                backoff=Backoff(attempts=3), cell_id="c1", incarnation="a")
    abandoned = raised.value
    assert isinstance(abandoned, PeerLost)  # an action cut short, never the run
    assert (count[0], abandoned.attempts, abandoned.stale) == (attempts, attempts, stale) and why in abandoned.reason
    event = abandoned.event("training")
    assert (event.cell_id, event.command, event.incarnation, event.switch_to) == ("c1", "join_step", "a", "training")


def test_a_lost_peer_is_abandoned_without_waiting() -> None:
    send, count = _sends(PeerLost("cell c1 was lost"))
    with pytest.raises(Abandoned, match="cell c1 was lost") as raised:
        perform(send, "join", command="join_step", rule=Rule.RETRY, obsolete=lambda: None,
                wait=lambda s: pytest.fail("waited for a lost peer"))
    assert raised.value.stale and count[0] == 1


# -- RemoteCell and Commands over a fake hub -------------------------------------------------------------------


class FakeHub:
    """Answers each command kind from a script (a CommandDone, or an exception the future raises); ok after."""

    def __init__(self, **script: list[gyre_pb2.CommandDone | BaseException]) -> None:
        self.script = script
        self.sent: list[tuple[str, str, str]] = []
        self.commands: list[gyre_pb2.CellCommand | gyre_pb2.ProxyCommand] = []
        self.lost: list[tuple[str, str, str]] = []
        self.on_send: dict[str, Any] = {}
        self.declared: set[tuple[str, str, str]] = set()
        """Incarnations the hub declared lost (its own knowledge, ahead of the log)."""
        self.asked = threading.Event()

    def _answer(self, target: str, kind: str, incarnation: str) -> Future[gyre_pb2.CommandDone]:
        self.sent.append((target, kind, incarnation))
        if kind in self.on_send:
            self.on_send[kind]()
        future: Future[gyre_pb2.CommandDone] = Future()
        outcomes = self.script.get(kind, [])
        outcome = outcomes.pop(0) if outcomes else gyre_pb2.CommandDone(ok=True, figures=FIGURES.get(kind, {}))
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        return future

    def command_cell(self, cell_id: str, command: gyre_pb2.CellCommand, *, incarnation: str = ""
                     ) -> Future[gyre_pb2.CommandDone]:
        self.commands.append(command)
        return self._answer(cell_id, command.WhichOneof("body"), incarnation)

    def command_proxy(self, command: gyre_pb2.ProxyCommand) -> Future[gyre_pb2.CommandDone]:
        self.commands.append(command)
        kind = command.WhichOneof("body")
        if kind == "redirects" and not self.script.get(kind):  # each cell's figures, named by cell
            self.script[kind] = [gyre_pb2.CommandDone(ok=True, figures={
                f"{r.from_cell_id}/{name}": value for r in command.redirects.cells
                for name, value in FIGURES["redirect"].items()})]
        return self._answer("proxy", kind, "")

    def lose(self, kind: str, peer_id: str, reason: str, incarnation: str = "") -> None:
        self.lost.append((kind, peer_id, incarnation))

    def is_lost(self, kind: str, peer_id: str, incarnation: str) -> bool:
        self.asked.set()
        return (kind, peer_id, incarnation) in self.declared


FIGURES = {"redirect": {"redirect_s": 0.1, "redirected_calls": 0.0}, "pause": {"engine_pause_s": 0.1},
           "join_step": {"trainer_join_s": 0.3}, "serve": {"engine_resume_s": 0.1},
           "to_training": {"engine_pause_s": 0.1, "release_s": 0.05, "trainer_join_s": 0.3},
           "to_rollout": {"trainer_leave_s": 0.1, "weights_bytes": 1e6, "weights_s": 0.2, "engine_resume_s": 0.1}}


class ListSink:
    """Events in a list, folded into ``live`` as they are recorded (as the controller's sink does)."""

    def __init__(self, live: LiveRun | None = None) -> None:
        self.events: list[Event] = []
        self.lock = threading.Lock()
        self.live = live or LiveRun()

    def record(self, events: Event | list[Event]) -> int:
        with self.lock:
            for event in [events] if isinstance(events, Event) else list(events):
                self.events.append(event)
                self.live.apply(len(self.events) - 1, event)
            return len(self.events) - 1

    def commit(self, position: int | None = None, **options: Any) -> None:
        pass

    def of(self, kind: type[Event]) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]


def _cluster(hub: FakeHub, *, attempts: int = 10, wait: Any = None) -> tuple[RemoteCell, ListSink, list, list]:
    sink = ListSink()
    sink.record([CellRegistered(cell_id="c0", role="training", is_core=True, slots=2, address="http://c0",
                                incarnation="core-a", trainer_endpoint="127.0.0.1:1"),
                 CellRegistered(cell_id="c1", role="rollout", slots=2, address="http://c1", incarnation="c1-a")])
    sink.events.clear()  # the registrations are the fixture, not what the test looks at
    waits: list[float] = []
    failures: list[BaseException] = []
    commands = Commands(hub, sink.live, sink, backoff=Backoff(attempts=attempts),  # type: ignore[arg-type]
                        wait=wait or (lambda s: waits.append(s) or False))
    cell = RemoteCell("c1", commands=commands, transfers=Transfers(sink.live), sink=sink, fail=failures.append,
                      upto=lambda: 0)
    return cell, sink, waits, failures


def _finish(*cells: RemoteCell) -> None:
    """Once every action queued so far is done (``close`` alone drops those not yet started), close."""
    for cell in cells:
        done = threading.Event()
        cell._actions.put(done.set)
        assert done.wait(10), f"cell {cell.cell_id}'s actions did not finish"
        cell.close()


TO_TRAINING = RoleSwitchRequested(cell_id="c1", from_role="rollout", to_role="training", decided_at_seq=2)


def test_a_join_while_the_core_restores_is_retried_and_succeeds() -> None:
    """The chaos run's failure: a satellite joins a restarted core that is still restoring its trainer."""
    hub = FakeHub(to_training=[failed_done(1, NOT_READY), failed_done(2, NOT_READY)])
    cell, sink, waits, failures = _cluster(hub)
    cell.switch(TO_TRAINING)
    _finish(cell)
    assert failures == [] and sink.of(CommandAbandoned) == [] and hub.lost == []
    [done] = sink.of(RoleSwitchCompleted)
    assert done.to_role == "training" and done.trainer_join_s == 0.3 and done.engine_pause_s == pytest.approx(0.15)
    joins = [s for s in hub.sent if s[1] == "to_training"]  # pause, release and join: one command, sent again whole
    assert joins == [("c1", "to_training", "c1-a")] * 3 and waits == [0.5, 1.0]


def test_a_fatal_failure_ends_the_run_with_one_line() -> None:
    hub = FakeHub(to_training=[failed_done(1, ConfigError("the satellite's backend needs CUDA"))])
    cell, sink, waits, failures = _cluster(hub)
    cell.switch(TO_TRAINING)
    cell._actions._thread.join(10)  # a failed action stops the cell's thread: the controller ends the run
    cell.close()
    [error] = failures
    assert str(error) == "switch to training on cell c1 failed (fatal): ConfigError: the satellite's backend needs CUDA"
    assert sink.of(RoleSwitchCompleted) == [] and sink.of(CommandAbandoned) == [] and waits == [] and hub.lost == []


def test_a_load_retried_past_a_newer_publish_is_sent_again_as_the_latest() -> None:
    """Chaos (partitions): a load whose pull a partition cut was sent again as it was, ten times, for a version
    the core no longer offered; the core's newer offer supersedes it, and the load is re-planned."""
    cut = TransferError("pulling v1 from 10.77.0.2 failed: connection timed out")
    hub = FakeHub(load_weights=[failed_done(1, cut)])
    published: list[int] = []

    def wait(seconds: float) -> bool:  # the core publishes v2 while the failed load backs off
        if not published:
            published.append(2)
            sink.record(WeightsPublished(policy_version=2, location="weights/v2", sha256="b"))
        return False

    cell, sink, _, failures = _cluster(hub, wait=wait)
    sink.record(WeightsPublished(policy_version=1, location="weights/v1", sha256="a"))
    cell.update_weights()
    _finish(cell)
    assert failures == [] and hub.lost == []
    assert [k for _, k, _ in hub.sent if k == "load_weights"] == ["load_weights", "load_weights"]
    [abandoned] = sink.of(CommandAbandoned)
    assert abandoned.command == "load_weights" and "v1 -> v2" in abandoned.reason
    assert [e.policy_version for e in sink.of(WeightsLoaded)] == [2]


TO_ROLLOUT = RoleSwitchRequested(cell_id="c1", from_role="training", to_role="rollout", decided_at_seq=2)


def test_a_return_to_rollout_is_one_command_and_its_load_is_recorded_before_the_completion() -> None:
    """Leave, load and serve go as one `ToRollout` (a step's end sends every returning cell's at once)."""
    hub = FakeHub()
    cell, sink, _, failures = _cluster(hub)
    sink.record(WeightsPublished(policy_version=1, location="weights/v1", sha256="a"))
    cell.switch(TO_ROLLOUT)
    _finish(cell)
    assert failures == [] and hub.sent == [("c1", "to_rollout", "c1-a"), ("proxy", "routing", "")]
    [command] = hub.commands[:1]
    assert command.to_rollout.leave and command.to_rollout.weights.version == 1
    assert not command.to_rollout.ask  # no step is being trained: the weights it was sent are the latest
    loaded, done = [e for e in sink.events if isinstance(e, (WeightsLoaded, RoleSwitchCompleted))]
    assert isinstance(loaded, WeightsLoaded) and isinstance(done, RoleSwitchCompleted)
    assert (loaded.policy_version, loaded.cause, loaded.weights_bytes) == (1, "return_to_rollout", 1_000_000)
    assert (done.weights_bytes, done.weights_s, done.engine_resume_s) == (1_000_000, 0.2, 0.1)


def test_a_return_sent_while_the_core_trains_asks_which_weights_to_load_after_its_leave() -> None:
    """A return sent just before a publish loads the new version itself: the cell asks once it has left the
    trainer (the hub answers from `load_plan`), instead of serving the old version and pausing again."""
    hub = FakeHub()
    cell, sink, _, failures = _cluster(hub)
    sink.record([WeightsPublished(policy_version=1, location="weights/v1", sha256="a"),
                 WeightsLoaded(cell_id="c1", policy_version=1, cause="publish")])
    assert cell.load_plan()[0] is False  # the lent cell's engine holds v1, the latest

    def leave_then_ask() -> None:  # the core publishes v2 while the cell leaves; then the cell asks
        sink.record(WeightsPublished(policy_version=2, location="weights/v2", sha256="b"))
        load, weights = cell.load_plan()
        assert load and weights.version == 2 and weights.location == "weights/v2"
        hub.script["to_rollout"] = [gyre_pb2.CommandDone(ok=True, figures={
            **FIGURES["to_rollout"], "weights_version": float(weights.version)})]

    hub.on_send["to_rollout"] = leave_then_ask
    with cell.transfers.training():  # a Train command in flight: the core may publish meanwhile
        assert cell.transfers.publishing()
        cell.switch(TO_ROLLOUT)
        _finish(cell)
    assert failures == []
    [command] = [c for c in hub.commands if c.WhichOneof("body") == "to_rollout"]
    assert command.to_rollout.ask and not command.to_rollout.HasField("weights")
    [loaded] = [e for e in sink.of(WeightsLoaded) if e.cause == "return_to_rollout"]
    assert (loaded.policy_version, loaded.weights_bytes) == (2, 1_000_000)
    [done] = sink.of(RoleSwitchCompleted)
    assert done.weights_bytes == 1_000_000
    assert cell.load_plan()[0] is False and not cell.transfers.publishing()


def test_publishing_lasts_from_a_train_until_the_log_names_its_version() -> None:
    """An emulated publish is recorded after its push: the core's offer comes first, the log's name later."""
    live = LiveRun()
    transfers = Transfers(live)
    assert not transfers.publishing()
    with transfers.training():
        assert transfers.publishing()
        transfers.offer(gyre_pb2.WeightsRef(version=1, location="weights/v1"), "core-a")
    assert transfers.publishing()  # offered, not yet named by the log
    live.apply(0, WeightsPublished(policy_version=1, location="weights/v1", sha256="a"))
    assert not transfers.publishing()


def test_what_a_weights_ask_reads_is_watched_for_the_plans_the_hub_follows() -> None:
    """The hub keeps a return's plan current (`Hub.weights_changed`) on each change of what a weights ask
    answers: a version the log names, the core's incarnation or loss (`LiveRun.watch_weights`), a copy the core
    offers (`Transfers.on_offer`) — and not on the folds that change none of them."""
    live = LiveRun()
    transfers = Transfers(live)
    changes: list[str] = []
    live.watch_weights(lambda: changes.append("log"))
    transfers.on_offer = lambda: changes.append("offer")
    live.apply(0, CellRegistered(cell_id="c0", role="training", is_core=True, slots=2, incarnation="c0-a"))
    live.apply(1, CellRegistered(cell_id="c1", role="rollout", slots=2, incarnation="c1-a"))
    assert changes == ["log"]  # the core registered; another cell changes no answer
    live.apply(2, WeightsPublished(policy_version=1, location="weights/v1", sha256="a"))
    live.apply(3, WeightsLoaded(cell_id="c1", policy_version=1, cause="publish", duration_s=0.1))
    transfers.offer(gyre_pb2.WeightsRef(version=1, location="weights/v1", peer_session="s"), "c0-a")
    live.apply(4, CellLost(cell_id="c0", reason="gone"))
    assert changes == ["log", "log", "offer", "log"]


def test_a_return_whose_load_was_superseded_is_sent_again_with_the_latest() -> None:
    cut = TransferError("pulling v1 from 10.77.0.2 failed: connection timed out")
    hub = FakeHub(to_rollout=[failed_done(1, cut)])

    def wait(seconds: float) -> bool:  # the core publishes v2 while the failed return backs off
        sink.record(WeightsPublished(policy_version=2, location="weights/v2", sha256="b"))
        return False

    cell, sink, _, failures = _cluster(hub, wait=wait)
    sink.record(WeightsPublished(policy_version=1, location="weights/v1", sha256="a"))
    cell.switch(TO_ROLLOUT)
    _finish(cell)
    assert failures == [] and hub.lost == []
    sent = [c.to_rollout.weights.version for c in hub.commands if c.WhichOneof("body") == "to_rollout"]
    assert sent == [1, 2]
    [abandoned] = sink.of(CommandAbandoned)
    assert abandoned.command == "to_rollout" and "v1 -> v2" in abandoned.reason and abandoned.switch_to is None
    assert [e.policy_version for e in sink.of(WeightsLoaded)] == [2] and len(sink.of(RoleSwitchCompleted)) == 1


def test_an_abandoned_switch_ends_and_its_live_cell_is_declared_lost() -> None:
    hub = FakeHub(to_training=[failed_done(i, NOT_READY) for i in range(3)])
    cell, sink, _, failures = _cluster(hub, attempts=3)
    cell.switch(TO_TRAINING)
    _finish(cell)
    assert failures == [] and sink.of(RoleSwitchCompleted) == []
    [abandoned] = sink.of(CommandAbandoned)
    assert (abandoned.cell_id, abandoned.command, abandoned.attempts, abandoned.incarnation, abandoned.switch_to) == (
        "c1", "to_training", 3, "c1-a", "training")
    assert hub.lost == [("cell", "c1", "c1-a")]  # restarted clean by the lost-cell path
    fold = SchedulerFold()
    for event in [CellRegistered(cell_id="c0", role="training", is_core=True, slots=2),
                  CellRegistered(cell_id="c1", role="rollout", slots=2), TO_TRAINING, abandoned]:
        fold.apply(event)
    c1 = fold.view.cluster.cells["c1"]
    assert (c1.role, c1.switching_to) == ("rollout", None) and fold.view.cells_in("rollout")[0].cell_id == "c1"
    logged = [e.model_copy(update={"ts": datetime(2025, 1, 1, tzinfo=UTC)})
              for e in [CellRegistered(cell_id="c1", role="rollout", slots=2), TO_TRAINING, abandoned]]
    columnar = fold_batches(ClusterView(), [encode(logged, 0)])  # replay's path: the same rule
    assert (columnar.cells["c1"].role, columnar.cells["c1"].switching_to) == ("rollout", None)


def test_a_late_abandon_does_not_end_a_switch_of_the_next_incarnation() -> None:
    """The old actuator's command gives up after its cell was replaced and a switch decided for the new one."""
    fold = SchedulerFold()
    for event in [CellRegistered(cell_id="c1", role="rollout", slots=2, incarnation="c1-a"), TO_TRAINING,
                  CellRegistered(cell_id="c1", role="rollout", slots=2, incarnation="c1-b"), TO_TRAINING,
                  CommandAbandoned(cell_id="c1", command="join_step", incarnation="c1-a", switch_to="training")]:
        fold.apply(event)
    assert fold.view.cluster.cells["c1"].switching_to == "training"
    fold.apply(CommandAbandoned(cell_id="c1", command="join_step", incarnation="c1-b", switch_to="training"))
    assert fold.view.cluster.cells["c1"].switching_to is None


def test_a_join_whose_core_was_replaced_is_abandoned_and_the_switch_completes() -> None:
    hub = FakeHub(to_training=[failed_done(1, NOT_READY)])
    cell: RemoteCell | None = None

    def core_restarts(seconds: float) -> bool:  # while the satellite waits, the core is replaced
        assert cell is not None
        cell.live.apply(99, CellRegistered(cell_id="c0", role="training", is_core=True, slots=2,
                                           incarnation="core-b", trainer_endpoint="127.0.0.1:2"))
        return False

    cell, sink, _, failures = _cluster(hub, wait=core_restarts)
    cell.switch(TO_TRAINING)
    _finish(cell)
    [abandoned] = sink.of(CommandAbandoned)
    assert abandoned.switch_to is None and "core c0 incarnation core-a" in abandoned.reason
    [done] = sink.of(RoleSwitchCompleted)  # it joins the restarted core when that one is up (rejoin)
    assert done.trainer_join_s == 0.0 and failures == [] and hub.lost == []
    # the failure may have cut the pause or the release: both are sent again, without the join
    first, again = [c.to_training for c in hub.commands if c.WhichOneof("body") == "to_training"]
    assert first.HasField("join") and not again.HasField("join") and again.pause_mode == "abort"


def test_an_abandoned_train_step_loses_its_core() -> None:
    """A step is never sent twice: its core is declared lost, and the lost-core path trains it again."""
    hub = FakeHub(train=[failed_done(1, NOT_READY)])
    cell, sink, waits, failures = _cluster(hub)
    core = RemoteCell("c0", commands=cell.commands, transfers=cell.transfers, sink=sink, fail=failures.append,
                      upto=lambda: 0)
    core.train(3, ("g0",))
    _finish(core, cell)
    [abandoned] = sink.of(CommandAbandoned)
    assert (abandoned.command, abandoned.attempts, abandoned.incarnation) == ("train", 1, "core-a")
    assert hub.lost == [("cell", "c0", "core-a")] and waits == [] and failures == []


def test_a_switch_abandoned_for_a_loss_the_log_does_not_hold_yet_ends_after_it() -> None:
    """Chaos seed 8: the hub declared the core lost; the log did not say so yet. Ended at once, the abandoned
    switch would be decided again on the same view, over and over: it ends once the loss is recorded."""
    hub = FakeHub(to_training=[PeerLost("cell c1 was lost (its process exited with status -9)")])
    hub.declared.add(("cell", "c1", "c1-a"))
    cell, sink, _, failures = _cluster(hub)
    cell.switch(TO_TRAINING)
    assert hub.asked.wait(10), "the abandon did not ask the hub whether the cell is lost"
    assert sink.of(CommandAbandoned) == []  # waits for the membership thread's record
    sink.record(CellLost(cell_id="c1", reason="its process exited with status -9"))
    _finish(cell)
    kinds = [type(e).__name__ for e in sink.events if isinstance(e, (CellLost, CommandAbandoned))]
    assert kinds == ["CellLost", "CommandAbandoned"] and failures == [] and hub.lost == []


def test_proxy_commands_follow_the_rule() -> None:
    hub = FakeHub(routing=[failed_done(1, NOT_READY)], queue=[failed_done(2, NOT_READY)],
                  redirect=[PeerLost("the proxy was lost")])
    cell, sink, waits, _ = _cluster(hub)
    commands = cell.commands
    assert commands.proxy("routing", routing=gyre_pb2.Routing()) is not None and waits == [0.5]
    assert commands.proxy("queue step 1", queue=gyre_pb2.QueueExecutions()) is None  # never queued twice
    assert commands.proxy("redirect", redirect=gyre_pb2.RedirectCell()) is None  # a lost proxy: its restart
    [abandoned] = sink.of(CommandAbandoned)
    assert (abandoned.target, abandoned.command, abandoned.cell_id) == ("proxy", "queue", None)
    assert hub.lost == [("proxy", "", "")]
    cell.close()


def test_redirects_asked_while_one_is_in_flight_go_as_one_command() -> None:
    """A step's end: many cells leave rollout at once. The redirects asked while one is in flight go together as
    the next command, and each cell gets its own figures back."""
    hub = FakeHub()
    cell, _, _, _ = _cluster(hub)
    commands = cell.commands
    others = [f"c{i}" for i in range(2, 6)]
    in_flight = threading.Event()

    def first_in_flight() -> None:  # the first redirect is at the proxy until every other one is asked
        hub.on_send.pop("redirects")
        in_flight.set()
        deadline = time.monotonic() + 10
        while len(commands._redirects) < len(others):  # waits for a state, not a duration
            assert time.monotonic() < deadline, "the other redirects were never asked"
            time.sleep(0.005)

    hub.on_send["redirects"] = first_in_flight
    figures: dict[str, dict[str, float] | None] = {}

    def redirect(cell_id: str) -> None:
        figures[cell_id] = commands.redirect(gyre_pb2.RedirectCell(from_cell_id=cell_id))

    threads = [threading.Thread(target=redirect, args=("c1",))]
    threads[0].start()
    assert in_flight.wait(10)
    threads += [threading.Thread(target=redirect, args=(c,)) for c in others]
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(10)
    sent = [[r.from_cell_id for r in c.redirects.cells] for c in hub.commands if c.WhichOneof("body") == "redirects"]
    assert len(sent) == 2 and sent[0] == ["c1"] and sorted(sent[1]) == others
    assert figures == {c: {"redirect_s": 0.1, "redirected_calls": 0.0} for c in ["c1", *others]}
    cell.close()


def test_commands_stop_retrying_when_the_run_stops() -> None:
    hub = FakeHub(serve=[failed_done(1, NOT_READY)])
    cell, _, _, _ = _cluster(hub)
    cell.commands.stopping.set()
    with pytest.raises(Abandoned, match="the run is stopping"):
        cell.commands.cell("c1", "serve", serve=gyre_pb2.Serve())
    assert hub.lost == []
    cell.close()


def test_a_join_refused_by_a_restoring_core_is_retried_over_the_real_stream(cluster) -> None:
    """End to end: a core's Trainer service that is not attached yet answers a real UNAVAILABLE; the cell's
    link reports it retryable; the controller's `Commands` sends the join again once it waited, and it is done."""
    from gyre.cluster.auth import metadata
    from gyre.cluster.trainer_service import TrainerServer

    server = TrainerServer(secret=cluster.secret, endpoint=None)  # type: ignore[arg-type]  # unused until attached
    server.start()
    restored = threading.Event()

    def handler(command: gyre_pb2.CellCommand) -> dict[str, float]:
        if not restored.is_set():  # what SatelliteReplica.join does first: Trainer.Join on the core
            with grpc.insecure_channel(server.address) as channel:
                gyre_pb2_grpc.TrainerStub(channel).Join(gyre_pb2.TrainerJoin(cell_id="c1"),
                                                        metadata=metadata(cluster.secret), timeout=10)
        return {"trainer_join_s": 0.2}

    try:
        cluster.link("c1", handler=handler, incarnation="c1-a")
        sink = ListSink()
        sink.record(CellRegistered(cell_id="c1", role="rollout", slots=2, incarnation="c1-a"))
        commands = Commands(cluster.hub, sink.live, sink, wait=lambda s: restored.set() or False)
        done = commands.cell("c1", "join step", join_step=gyre_pb2.JoinStep(trainer_endpoint=server.address))
        assert done.figures["trainer_join_s"] == pytest.approx(0.2) and restored.is_set()
    finally:
        server.stop()


def test_a_process_refused_for_good_exits_so_its_supervisor_starts_a_new_incarnation() -> None:
    """Cut off by a partition, a cell is declared lost; when the link heals its stream is refused for good. It
    must exit (non-zero) rather than live on unreachable: under launcher "manual" nobody else would restart it."""
    from gyre.cluster.errors import ClusterError
    from gyre.cluster.node import serve_until_stopped

    class Link:
        error: Exception | None = None
        on_failed: Any = None

    class Node:
        def __init__(self) -> None:
            self.stopped, self.link, self.closed = threading.Event(), Link(), False

        def start(self) -> None:  # the hub refuses the old incarnation as soon as it says hello again
            self.link.error = ClusterError("cell 'cell2' incarnation 'a' was declared lost")
            self.link.on_failed(self.link.error)

        def close(self) -> None:
            self.closed = True

    node = Node()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.raises(SystemExit, match=r"refused this process for good.*declared lost"):
            serve_until_stopped(node)
    finally:  # serve_until_stopped takes the signals, as a process's main does
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert node.closed and not node.stopped.is_set()
