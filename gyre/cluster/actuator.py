"""The controller's side of a cluster: each cell's actuator as commands down its stream, rollouts via the proxy.

`RemoteCell` is the `CellActuator` of a cell process. It performs a recorded decision as a sequence of
commands, one at a time on the cell's own thread, and records `role_switch_completed` only once every part
has completed, with each part's measured seconds and bytes as the processes reported them:

- rollout -> training: the proxy stops admitting executions to the cell and redirects its in-flight calls
  exactly as the decision's plan says (`redirect_s`, `redirected_calls`); with partial rollouts the
  executions the plan does not move are cut instead (`gyre.proxy.core.Proxy.cut`: each `execution_queued`
  again, its slot released, its call aborted and continued — tokens kept, re-prefilled — once it is placed
  again on a cell holding the latest published version or newer); the cell pauses its engine
  (`engine_pause_s`) and releases its memory; it joins training (`trainer_join_s`): the core's replica is
  resident, a satellite pulls the current weights from the core over Mooncake and claims micro-steps. The
  cell's three steps go as one `ToTraining` command.
- training -> rollout: a satellite leaves the trainer; the cell loads the latest published weights into its
  engine (`weights_bytes`, `weights_s`: a Mooncake pull from the core), resumes it (`engine_resume_s`) — the
  three as one `ToRollout` command, so that a step's end costs each returning cell one round trip, not three —
  and the proxy admits executions to it again.
- a version published while the cell serves rollouts (`update_weights`): the engine drains its calls in
  flight and loads it, and the proxy's routing says so; every load records `weights_loaded`, and the proxy
  places an execution only on a cell holding the version it was queued with (docs/design.md, "the version
  contract").

What an actuator knows of the cluster — each cell's role, incarnation and addresses, the version each
engine serves, the latest weights — it reads from `gyre.run.live.LiveRun`, the log folded as events are
recorded; the proxy's routing is built from it too (`routing`). The one fact kept beside the log is where
the core holds the latest version in its Mooncake memory (`Transfers`, from its Train answer): a runtime
address, valid only while that core incarnation lives.

A failed command follows one rule (`gyre.cluster.failures`): a transient failure is sent again with
bounded backoff, or abandoned (``command_abandoned``; an abandoned switch ends there, its cell staying in
its role) when the decision it served is obsolete or its attempts ran out — and then a target still alive is
declared lost; a fatal failure ends the run. A process lost mid-action (`PeerLost`, which an abandoned
command is too) does not fail the run: the action is cut short, and the controller's membership handling
restarts the process, registers it again and brings it up (`RemoteCell.bring_up`); a train step it
abandoned is trained again once a core is back. A command to a lost proxy is answered with nothing: a
restarted proxy has no calls to redirect, gets the routing when it connects, and the executions it lost are
submitted again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from gyre import auth
from gyre.cluster.errors import PeerLost
from gyre.cluster.failures import (
    CELL_RULES,
    COMMAND_TIMEOUT_S,
    PROXY_RULES,
    Abandoned,
    Backoff,
    CommandFailed,
    perform,
    wait_done,
)
from gyre.cluster.proto import gyre_pb2
from gyre.controller.actuator import OrderedActions, perform_switch
from gyre.errors import GyreError
from gyre.events.models import RoleSwitchRequested, WeightsLoaded
from gyre.sink import EventSink

if TYPE_CHECKING:
    from gyre.cluster.hub import Hub
    from gyre.run.live import LiveRun
    from gyre.state.cluster import Cell

log = logging.getLogger(__name__)

__all__ = ["COMMAND_TIMEOUT_S", "CommandFailed", "wait_done"]  # the rule's names, where callers found them


def routing(live: LiveRun) -> gyre_pb2.Routing:
    """Every registered cell's engine and the version it serves; only a cell settled in rollout admits (a
    lost one admits nothing: its calls move when its engine fails them)."""
    return gyre_pb2.Routing(cells=[
        gyre_pb2.CellRoute(cell_id=c.cell_id, engine_url=c.address or "", slots=c.slots,
                           admitting=c.settled_in("rollout"), weights_version=version)
        for c, version in live.routes()])


class Transfers:
    """Where the core holds the latest published version in Mooncake memory (its Train answer): readers pull
    it from there rather than from the file, while that core incarnation lives. And whether a version may be
    published soon (`publishing`)."""

    def __init__(self, live: LiveRun) -> None:
        self.live = live
        self._lock = threading.Lock()
        self._ref: gyre_pb2.WeightsRef | None = None
        self._incarnation: str | None = None
        self._training = 0
        self.on_offer: Callable[[], None] | None = None
        """Called after an offer (the answer to a weights ask may now carry the core's copy)."""

    def offer(self, ref: gyre_pb2.WeightsRef, incarnation: str | None) -> None:
        with self._lock:
            if self._ref is None or ref.version >= self._ref.version:
                self._ref, self._incarnation = ref, incarnation
        if self.on_offer is not None:
            self.on_offer()

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Around a Train command: while it runs the core may publish a version."""
        with self._lock:
            self._training += 1
        try:
            yield
        finally:
            with self._lock:
                self._training -= 1

    def publishing(self) -> bool:
        """Whether the log may soon name a newer version: a Train command is in flight, or the core offered a
        version the log does not name yet (an emulated publish is recorded after its push)."""
        latest = self.live.latest()
        with self._lock:
            return self._training > 0 or (self._ref is not None
                                          and self._ref.version > (latest.version if latest is not None else 0))

    def latest(self) -> gyre_pb2.WeightsRef:
        """The latest published weights as the log names them (version 0: the initial weights), with the
        core's Mooncake copy when the core that published them still serves."""
        weights, core = self.live.latest(), self.live.core()
        if weights is None:
            return gyre_pb2.WeightsRef(version=0)
        ref = gyre_pb2.WeightsRef(version=weights.version, location=weights.location, sha256=weights.sha256)
        with self._lock:
            held = self._ref
            if (held is not None and held.version == weights.version and core is not None and not core.lost
                    and core.incarnation == self._incarnation):
                ref.peer_session, ref.manifest = held.peer_session, held.manifest
        return ref


class Commands:
    """Typed commands to the processes through the hub, each sent under the failed-command rule."""

    def __init__(self, hub: Hub, live: LiveRun | None = None, sink: EventSink | None = None, *,
                 backoff: Backoff = Backoff(), wait: Callable[[float], bool] | None = None) -> None:
        """``live``: the run's cells (commands are fenced to the incarnation the log registered; None: not
        fenced); ``sink``: where abandoned proxy commands are recorded; ``wait(s)``: the backoff's sleep
        (True when the run began stopping meanwhile; default: ``stopping.wait``)."""
        self.hub, self.live, self.sink, self.backoff = hub, live, sink, backoff
        self.stopping = threading.Event()
        """Set when the run stops: retries end, their commands abandoned."""
        self.wait = wait if wait is not None else self.stopping.wait
        self._routing = threading.Condition()
        self._routes_asked = self._routes_sent = 0
        self._routing_in_flight = False
        self._redirecting = threading.Condition()
        self._redirects: list[tuple[gyre_pb2.RedirectCell, list[gyre_pb2.CommandDone | BaseException | None]]] = []
        self._redirect_in_flight = False

    def route(self) -> None:
        """Tell the proxy what the log says of every cell now. A routing is a snapshot, so asks are coalesced:
        one that finds a routing in flight waits for the next, which is built after it asked and so carries
        its change (at 256 cells a publish made each rollout cell's actuator send the whole table in turn)."""
        assert self.live is not None, "routing needs the run's cells"
        with self._routing:
            self._routes_asked += 1
            ticket = self._routes_asked
            while self._routes_sent < ticket:
                if self._routing_in_flight:
                    self._routing.wait()
                    continue
                self._routing_in_flight, covers = True, self._routes_asked
                self._routing.release()
                try:
                    self.proxy("routing", routing=routing(self.live))
                finally:
                    self._routing.acquire()
                    self._routing_in_flight = False
                    self._routing.notify_all()
                self._routes_sent = covers  # one in flight at a time: what each covers only grows

    def redirect(self, redirect: gyre_pb2.RedirectCell) -> dict[str, float] | None:
        """Have the proxy redirect one leaving cell's calls; that cell's figures (None: the proxy was lost, or the
        command abandoned, before it was done). Coalesced as routings are: the redirects asked while one command
        is in flight go together, in the order they were asked, as the next (`RedirectCells`) — at a step's end
        ~120 cells of 256 leave rollout at once, and a command each queued them on the proxy's one command
        thread (a redirect's wait for it p99 3-13 s on a loaded VM; `docs/benchmarks.md`)."""
        outcome: list[gyre_pb2.CommandDone | BaseException | None] = []
        with self._redirecting:
            self._redirects.append((redirect, outcome))
            while not outcome:
                if self._redirect_in_flight:
                    self._redirecting.wait()
                    continue
                batch, self._redirects = self._redirects, []
                self._redirect_in_flight = True
                self._redirecting.release()
                done: gyre_pb2.CommandDone | BaseException | None = None
                try:
                    done = self.proxy(f"redirect of {', '.join(r.from_cell_id for r, _ in batch)}",
                                      redirects=gyre_pb2.RedirectCells(cells=[r for r, _ in batch]))
                except BaseException as error:  # a fatal failure: every cell of the batch raises it
                    done = error
                finally:
                    self._redirecting.acquire()
                    self._redirect_in_flight = False
                    for _, waiting in batch:
                        waiting.append(done)
                    self._redirecting.notify_all()
        done = outcome[0]
        if isinstance(done, BaseException):
            raise done
        if done is None:
            return None
        mine: dict[str, float] = {}
        for key, value in done.figures.items():
            cell_id, _, name = key.rpartition("/")
            if cell_id == redirect.from_cell_id:
                mine[name] = value
        return mine

    def cell(self, cell_id: str, what: str, *, obsolete: Callable[[], str | None] | None = None,
             **body: object) -> gyre_pb2.CommandDone:
        """Do a command on the cell's current incarnation (fenced: never on a later one). ``obsolete()``: why
        the decision it serves no longer holds besides its cell being lost or replaced (None: it holds)."""
        command = gyre_pb2.CellCommand(**body)
        kind = command.WhichOneof("body") or ""
        info = self.live.cell(cell_id) if self.live is not None else None
        incarnation = (info.incarnation or "") if info is not None else ""

        def stale() -> str | None:
            if self.stopping.is_set():
                return "the run is stopping"
            now = self.live.cell(cell_id) if self.live is not None else None
            if info is not None and (now is None or now.incarnation != info.incarnation or now.lost):
                return f"cell {cell_id} incarnation {incarnation} was lost or replaced"
            return obsolete() if obsolete is not None else None

        return perform(lambda: wait_done(self.hub.command_cell(cell_id, command, incarnation=incarnation),
                                         f"{what} on cell {cell_id}"),
                       f"{what} on cell {cell_id}", command=kind, rule=CELL_RULES[kind], obsolete=stale,
                       wait=self.wait, backoff=self.backoff, cell_id=cell_id, incarnation=incarnation)

    def proxy(self, what: str, **body: object) -> gyre_pb2.CommandDone | None:
        """None when the proxy was lost, or the command abandoned, before it was done (see the module docstring)."""
        command = gyre_pb2.ProxyCommand(**body)
        kind = command.WhichOneof("body") or ""
        try:
            return perform(lambda: wait_done(self.hub.command_proxy(command), f"{what} on the proxy"),
                           f"{what} on the proxy", command=kind, rule=PROXY_RULES[kind],
                           obsolete=lambda: "the run is stopping" if self.stopping.is_set() else None,
                           wait=self.wait, backoff=self.backoff)
        except Abandoned as abandoned:
            log.warning("%s", abandoned)
            if not isinstance(abandoned.__cause__, PeerLost):  # a lost proxy's story is its restart, not this
                self.abandon(abandoned, self.sink)
            return None

    def abandon(self, abandoned: Abandoned, sink: EventSink | None, switch_to: str | None = None) -> None:
        """Record ``command_abandoned``; a target still alive (its attempts ran out) is declared lost, so
        the lost-peer path restarts it clean and redoes what the command was for."""
        self._await_recorded_loss(abandoned)
        if sink is not None:
            try:
                sink.commit(sink.record(abandoned.event(switch_to)))
            except GyreError as error:  # the log closed as the run ended: nothing waits for the fact
                log.warning("%s; not recorded: %s", abandoned, error)
        if not abandoned.stale:
            kind, peer = ("cell", abandoned.cell_id) if abandoned.cell_id else ("proxy", "")
            self.hub.lose(kind, peer, f"{abandoned.what} was abandoned: {abandoned.reason}", abandoned.incarnation)

    def _await_recorded_loss(self, abandoned: Abandoned) -> None:
        """A command abandoned because the hub declared its cell's incarnation lost is recorded only once the
        log says so too. Recorded earlier, it would end the switch on a log that still shows the cell alive,
        and the policy would decide the same switch again at once (chaos seed 8: 1,108 pauses in 23 s while
        the loss waited to be recorded)."""
        cell_id, incarnation = abandoned.cell_id, abandoned.incarnation
        if self.live is None or not cell_id or not incarnation or not self.hub.is_lost("cell", cell_id, incarnation):
            return
        live, deadline = self.live, time.monotonic() + LOSS_RECORD_WAIT_S
        while not live.wait_for(lambda live: not _is(live.cells.cells.get(cell_id), incarnation), 0.5):
            if self.stopping.is_set():
                return
            if time.monotonic() < deadline:
                continue
            log.warning("cell %s incarnation %s: the hub declared it lost %.0f s ago and the log does not say so "
                        "yet; its abandoned %s is recorded now", cell_id, incarnation, LOSS_RECORD_WAIT_S,
                        abandoned.command)
            return


class RemoteCell:
    """A cell process's actuator: decisions and train steps as ordered commands, completions as events."""

    def __init__(self, cell_id: str, *, commands: Commands, transfers: Transfers, sink: EventSink,
                 fail: Callable[[BaseException], None], upto: Callable[[], int], cut: bool = False) -> None:
        """``cut``: the run's policy uses partial rollouts: what a leaving cell does not redirect is cut."""
        self.cell_id = cell_id
        self.cut = cut
        self.commands, self.transfers, self.sink, self.fail = commands, transfers, sink, fail
        self.live: LiveRun = transfers.live
        self.upto = upto
        """The controller's folded seq: a train step's batch is built from that (durable) log prefix."""
        self._actions = OrderedActions(cell_id, fail, tolerate=lambda error: isinstance(error, PeerLost))
        self.on_lost_train: Callable[[], None] | None = None
        """Told when a train step reaches this actuator after it was closed (the controller trains it again)."""

    @property
    def info(self) -> Cell:
        """The cell as the log says now (a copy)."""
        cell = self.live.cell(self.cell_id)
        if cell is None:
            raise RuntimeError(f"cell {self.cell_id} is not registered in the log")
        return cell

    def _route(self) -> None:
        self.commands.route()

    # -- the actuator interface -----------------------------------------------------------------------------

    def switch(self, decision: RoleSwitchRequested) -> None:
        self._actions.put(self._guarded(lambda: self._switch(decision), switch_to=decision.to_role))

    def train(self, step: int, groups: tuple[str, ...]) -> None:
        """Abandoned, the step's core is lost (declared so if it was not): `Controller.forget_training`, on
        that path, has it trained again once a core is back."""
        if not self._actions.put(self._guarded(lambda: self._train(step, groups))) and self.on_lost_train is not None:
            self.on_lost_train()  # the core was lost as the step was handed over: it is trained again later

    def bring_up(self, role: str, incarnation: str, then: Callable[[], None] | None = None) -> None:
        """A (re)started process, or one the policy starts in training (async's fixed pool), registered in
        ``role``: give it that role's state (engine weights and admission for rollout; a paused and released
        engine, and for a satellite a replica joined to the core's trainer, for training); then ``then()``
        (once its first command is done the process is ready: a restarted core has restored its trainer).
        Queued before its `cell_registered` is recorded (a decision for the new cell must follow it), it
        starts once the log holds ``incarnation``."""
        def action() -> None:
            registered = self.live.wait_for(lambda live: _is(live.cells.cells.get(self.cell_id), incarnation),
                                            REGISTER_WAIT_S)
            if not registered:
                raise PeerLost(f"cell {self.cell_id} incarnation {incarnation} was not registered within "
                               f"{REGISTER_WAIT_S:.0f}s")
            self._bring_up(role)
            if then is not None:
                then()
        self._actions.put(self._guarded(action))

    def update_weights(self, cause: str = "publish") -> None:
        """A version was published (or the cell was adopted with its engine's version unknown): a cell that
        serves rollouts loads it, and the proxy admits executions queued with it there once it has."""
        self._actions.put(self._guarded(lambda: self._update_weights(cause)))

    def rejoin(self) -> None:
        """The core restarted: a satellite joins its new Trainer service (its old one died with the core)."""
        self._actions.put(self._guarded(self._rejoin))

    def close(self, wait: bool = True) -> None:
        self._actions.close(wait)

    # -- actions --------------------------------------------------------------------------------------------

    def _guarded(self, action: Callable[[], None], switch_to: str | None = None) -> Callable[[], None]:
        """``action``, with a command it abandons recorded (and, with ``switch_to``, the switch it served
        ended); the `Abandoned` goes on to cut the action short."""
        def run() -> None:
            try:
                action()
            except Abandoned as abandoned:
                self.commands.abandon(abandoned, self.sink, switch_to)
                raise
        return run

    def _switch(self, decision: RoleSwitchRequested) -> None:
        perform_switch(self.cell_id, decision, self.sink, self)
        self._route()  # the completion is recorded: the routing says what the cell admits now

    # -- role switches: the steps of `gyre.controller.actuator.CellOps`, as commands ------------------------

    def stop_admitting(self) -> None:
        self._route()  # the decision is recorded: the cell is no longer settled in rollout

    def redirect(self, decision: RoleSwitchRequested) -> tuple[int, float | None]:
        calls = [gyre_pb2.CallRedirect(call_id=r.call_id, execution_id=r.execution_id, to_cell_id=r.to_cell_id)
                 for r in decision.redirects]
        figures = self.commands.redirect(gyre_pb2.RedirectCell(
            from_cell_id=self.cell_id, calls=calls, cut=self.cut,
            resume_version=self.transfers.latest().version if self.cut else 0))
        if figures is None:  # a lost proxy: its restart has no calls in flight
            return 0, 0.0
        return int(figures["redirected_calls"]), figures["redirect_s"]

    def drain(self) -> float:
        return 0.0  # the redirect moved its executions to other cells: nothing is left to wait for

    def to_training(self) -> dict:
        return self._to_training(join=True)

    def to_rollout(self, cause: str) -> dict:
        return self._to_rollout(cause, leave=not self.info.is_core)

    def admit(self) -> None:
        """The proxy admits here once the completion is recorded (`_switch` sends the routing after it)."""

    def _to_training(self, *, join: bool) -> dict:
        """`CellOps.to_training` as one `ToTraining` command — pause, release, and with ``join`` join the core's
        step (`_join`); its parts."""
        to = gyre_pb2.ToTraining(pause_mode="abort")
        figures = (self._join(to) if join else
                   self.commands.cell(self.cell_id, "switch to training", to_training=to).figures)
        return {"engine_pause_s": figures.get("engine_pause_s", 0.0) + figures.get("release_s", 0.0),
                "trainer_join_s": figures.get("trainer_join_s", 0.0)}

    def _join(self, to: gyre_pb2.ToTraining | None = None) -> Mapping[str, float]:
        """Join the core's step (with ``to``: in that `ToTraining`, after its pause and release); the figures.
        No join when the core is down — its restart makes every training cell rejoin — but ``to``'s pause
        and release are still done (sent again without the join: the failure may have cut them)."""
        core = self.live.core()
        if core is None:
            raise RuntimeError("no core is registered in the log")

        def core_gone() -> str | None:
            now = self.live.core()
            if now is None or now.lost or now.incarnation != core.incarnation:
                return f"the core {core.cell_id} incarnation {core.incarnation} was lost or replaced"
            return None

        join = gyre_pb2.JoinStep(trainer_endpoint=core.trainer_endpoint or "", weights=self.transfers.latest())
        try:
            if to is None:
                return self.commands.cell(self.cell_id, "join step", obsolete=core_gone, join_step=join).figures
            to.join.CopyFrom(join)
            return self.commands.cell(self.cell_id, "switch to training", obsolete=core_gone, to_training=to).figures
        except (Abandoned, CommandFailed) as error:
            if core_gone() is None:
                raise
            if isinstance(error, Abandoned):
                self.commands.abandon(error, self.sink)
            log.warning("cell %s: the core went down while it joined (%s); it joins the restarted core", self.cell_id,
                        error)
        if to is None:
            return {"trainer_join_s": 0.0}
        to.ClearField("join")
        return {**self.commands.cell(self.cell_id, "switch to training", to_training=to).figures, "trainer_join_s": 0.0}

    def _rejoin(self) -> None:
        info = self.info
        if info.is_core or info.lost or info.role != "training":
            return
        self._join()

    def _bring_up(self, role: str) -> None:
        if role == "training":
            self._to_training(join=not self.info.is_core)
        else:
            self._to_rollout("bring_up", leave=False)
        self._route()

    def _to_rollout(self, cause: str, *, leave: bool) -> dict:
        """`CellOps.to_rollout` as one `ToRollout` command (`_load_latest`); its parts."""
        done = self._load_latest(cause, leave=leave)
        figures = done.figures if done is not None else {}
        weights_bytes = int(figures.get("weights_bytes", 0))
        return {"weights_bytes": weights_bytes, "weights_s": figures.get("weights_s", 0.0) if weights_bytes else 0.0,
                "engine_resume_s": figures.get("engine_resume_s", 0.0)}

    def load_plan(self) -> tuple[bool, gyre_pb2.WeightsRef]:
        """The latest weights the log names now, and whether the log says this cell's engine lacks them (what a
        load is for; also the hub's answer to the cell's `WeightsAsk`)."""
        weights = self.transfers.latest()
        return weights.version != self.live.engine_version(self.cell_id), weights

    def _load_latest(self, cause: str, *, force: bool = False,
                     leave: bool | None = None) -> gyre_pb2.CommandDone | None:
        """Bring the engine to the latest published version and record `weights_loaded`; the caller sends the
        proxy the routing that says so. The command's done; None when none was sent: the log says the engine
        holds the version already (nothing is recorded then) unless ``force`` (an adopted engine whose load
        may have gone unrecorded), or the version is v0 (the initial weights, with no file: its
        `weights_loaded` is recorded). With ``leave`` (a return to rollout, or a bring-up in it) one
        `ToRollout` command does it — leaving the trainer first when ``leave`` is True, resuming the engine
        after — and is sent whether or not there is a load; the recorded ``duration_s`` then runs from the
        first send to the engine serving, less the leave. A leave while the core may publish (`Transfers.
        publishing`) has the cell ask which weights to load once it has left (`ToRollout.ask`): a return sent
        just before a publish then loads the new version itself, instead of serving the old one and pausing
        again for the publish's load right after.

        A load retried after the core offered newer weights (or a new copy) is abandoned and re-planned as
        the load of what the core offers now (`_superseded`); a `ToRollout` is sent again whole, each of its
        steps being safe to redo (one that asks, asks again)."""
        load, weights = self.load_plan()
        load = load or force
        to_rollout = leave is not None
        ask = bool(leave) and self.transfers.publishing()
        done = None
        if not load and not to_rollout:
            return None
        started = time.perf_counter()
        while to_rollout or weights.location:
            sent = weights if load and weights.location and not ask else None
            obsolete = (lambda sent=sent: self._superseded(sent)) if sent is not None else None
            try:
                if to_rollout:
                    body = gyre_pb2.ToRollout(leave=bool(leave), reason="returning to rollout", ask=ask)
                    if sent is not None:
                        body.weights.CopyFrom(sent)
                    done = self.commands.cell(self.cell_id, "switch to rollout", obsolete=obsolete, to_rollout=body)
                else:
                    done = self.commands.cell(self.cell_id, "load weights", obsolete=obsolete,
                                              load_weights=gyre_pb2.LoadWeights(weights=sent))
                break
            except Abandoned as abandoned:
                if sent is None or not abandoned.reason.startswith(SUPERSEDED):
                    raise
                self.commands.abandon(abandoned, self.sink)  # re-planned: the load of what the core offers now
                weights = self.transfers.latest()
        figures = done.figures if done is not None else {}
        version: int | None = weights.version if load else None
        if ask:  # the cell asked after its leave: it names what it loaded (nothing: its engine held the latest)
            version = int(figures["weights_version"]) if "weights_version" in figures else None
        if version is not None:
            position = self.sink.record(WeightsLoaded(
                cell_id=self.cell_id, policy_version=version, cause=cause,
                duration_s=max(0.0, time.perf_counter() - started - figures.get("trainer_leave_s", 0.0)),
                drain_s=figures.get("drain_s", 0.0), weights_bytes=int(figures.get("weights_bytes", 0))))
            if cause != "return_to_rollout":  # a return's completion, committed next (`perform_switch`), covers it:
                self.sink.commit(position)    # a wait less for each of a step end's ~120 returning actuators
        return done

    def _superseded(self, sent: gyre_pb2.WeightsRef) -> str | None:
        """Why a load being retried is obsolete: the core now offers a newer version, or a Mooncake copy the
        load did not carry (a partition cut its pull; the copy it named is gone). Sent again as it was, it
        could never succeed (chaos, partitions: ten retries of a version the core no longer held)."""
        now = self.transfers.latest()
        if now == sent:
            return None
        return f"{SUPERSEDED} (v{sent.version} -> v{now.version}{', a new copy' * (now.version == sent.version)})"

    def _update_weights(self, cause: str) -> None:
        info = self.info
        if info.lost or info.role != "rollout":
            return  # a training cell loads the latest version when it returns to rollout
        if self._load_latest(cause, force=cause == "resume") is not None or cause == "resume":
            self._route()

    def _train(self, step: int, groups: tuple[str, ...]) -> None:
        upto = self.upto()
        self.sink.commit(upto)  # the batch's calls and rewards are durable before the core queries them
        with self.transfers.training():
            done = self.commands.cell(self.cell_id, f"train step {step}",
                                      train=gyre_pb2.Train(step=step, groups=list(groups), upto_seq=upto))
            if done.detail:
                self.transfers.offer(gyre_pb2.WeightsRef.FromString(done.detail), self.info.incarnation)


SUPERSEDED = "superseded by the weights the core offers now"
"""The reason of a load abandoned to be sent again as the latest weights (`RemoteCell._load_latest`)."""
LOSS_RECORD_WAIT_S = 60.0
"""How long an abandoned command waits for its cell's loss, declared by the hub, to be recorded (the
membership thread records it; a loss reported while the run starts is recorded once it has started)."""
REGISTER_WAIT_S = 60.0
"""How long a new incarnation's bring-up waits for its registration to be recorded (the membership thread
records it right after queueing the bring-up)."""


def _is(cell: Cell | None, incarnation: str) -> bool:
    return cell is not None and not cell.lost and (cell.incarnation or "") == incarnation


def execution_spec(execution_id: str, group_id: str, task_id: str, step: int, policy_version: int,
                   attempt: int) -> gyre_pb2.ExecutionSpec:
    """An execution to queue on the proxy, with a token the controller mints for it."""
    return gyre_pb2.ExecutionSpec(execution_id=execution_id, group_id=group_id, task_id=task_id, step=step,
                                  policy_version=policy_version, attempt=attempt, token=auth.mint())
