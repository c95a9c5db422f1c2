"""The controller's end of the control plane: one bidi stream per cell and two for the proxy, plus Admin.

A `Hub` serves the Cell, Proxy and Admin services (grpc.aio, behind the run secret) on its own thread and
event loop, so the controller's synchronous code keeps its threads. Per stream:

- the first message up must be hello; the hub answers `Welcome` with where each of the process's producers
  stands in the log (``held``), so a restarted process continues at held + 1;
- event batches are recorded into the sink in arrival order (only stamped events: exactly once needs the
  stamps) and acknowledged once durable — each wait on its own task, so one fsync never stalls the stream;
  a refused batch (a gap, a closed log) is acknowledged with its error and ends the stream (what the stream
  sent after it is dropped). A batch is checked and recorded on the hub's one ingest thread, not on the loop,
  and the stream's next message is read meanwhile (up to `INGEST_AHEAD` batches in flight): batches are
  recorded in arrival order (one thread), and a done takes effect only once the batches sent before it are
  recorded, so order within a stream holds; every other stream's commands, acks and heartbeats go on;
- commands go down with a ``command_id``; the caller's future resolves with the process's `CommandDone`.
  Commands not yet done are sent again when the same incarnation reconnects (the process runs each id once
  and answers a repeat with its recorded `CommandDone`);
- a cell may ask, in the middle of a command, which weights its engine should load (`WeightsAsk`, a return to
  rollout's load once its leave is over): the hub answers down the stream at once from ``on_weights_ask``.
  A ToRollout that asks goes down with the answer as it stands (`ToRollout.plan`), and until its done comes up
  the hub sends a newer answer whenever ``weights_changed()`` finds it changed: a cell that reads the plan
  loads the last answer it received, with no ask (two messages fewer for each of a step end's returns).

A process may open several streams (*lanes*, `ProxyHello.lanes`; the hub keys a peer's streams by lane): the
proxy's events lane carries its events, its commands lane its commands and their dones, so a done does not wait
behind the event batches of the other (a done waits only for its own stream's batches; a command that recorded
events answers once they are acknowledged durable). The peer is connected once every lane it names is, is lost
when any of them is (silent, or gone for ``dead_after_s``: both end), and after a Stop leaves once all have ended.

A peer is *lost* — ``on_cell_lost`` / ``on_proxy_lost``, its pending commands failed with `ClusterError` —
when its stream ended and did not come back within ``dead_after_s``, when nothing arrived on a live stream
for ``dead_after_s`` (heartbeats missed), or when a new incarnation of the same id connected (the old process
is gone). A link's clean close looks like any other ended stream (gRPC shows a cancelled call as the end of
its requests too), so it is lost after ``dead_after_s`` as well — except after a Stop command it has done:
then its stream's end is its exit, and it leaves at once, without ``on_*_lost``. A lost incarnation is
refused if it comes back: the controller has already acted on its loss, so only a restarted process (a new
incarnation) rejoins.

Incarnations fence each other: once a newer incarnation of a peer has connected, the older one is lost, so
its stream, its hello if it comes back, and therefore its events are refused; a command addressed to an
incarnation (``command_cell(..., incarnation=)``) is refused unless that incarnation is the connected one.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gyre.cluster.address import bracket
from gyre.cluster.aio import GRPC_OPTIONS, LoopThread
from gyre.cluster.auth import SecretInterceptor
from gyre.cluster.errors import ClusterError, PeerLost
from gyre.cluster.link import COMMANDS_LANE, EVENTS_LANE
from gyre.cluster.proto import gyre_pb2, gyre_pb2_grpc
from gyre.cluster.tls import TlsSection, add_port
from gyre.errors import GyreError
from gyre.events.wire import batch_to_ipc, unpack_batches
from gyre.log import LogReader
from gyre.sink import LogSink

log = logging.getLogger(__name__)

Hello = gyre_pb2.CellHello | gyre_pb2.ProxyHello
Command = gyre_pb2.CellCommand | gyre_pb2.ProxyCommand
Key = tuple[str, str]
"""("cell", cell_id), or ("proxy", "") for the run's one proxy."""

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    *GRPC_OPTIONS,
    ("grpc.so_reuseport", 0),  # an explicit port already taken is an error, not a second silent listener
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),  # links' keepalive pings are welcome
    ("grpc.http2.max_ping_strikes", 0),
)


@dataclass
class _End:
    """Queued last on a stream: end it with ``code`` (None: end it cleanly)."""

    code: grpc.StatusCode | None
    message: str


class _Stream:
    """One connected call (a peer's lane): the messages queued down it, its last batch in ingest, why it ended."""

    def __init__(self, hello: Hello) -> None:
        self.hello = hello
        self.lane = lane_of(hello)
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.ended: _End | None = None
        self.refused = False
        """A batch of it was refused (set on the ingest thread): nothing it sent after takes effect."""
        self.ingest: asyncio.Future[int] | None = None
        """Its last batch handed to the ingest thread: a done it sends takes effect after it (a done on another
        lane of the peer does not wait for this one's batches)."""

    def send(self, message: Any) -> None:
        if self.ended is None:
            self.queue.put_nowait(message)

    def end(self, code: grpc.StatusCode | None, message: str) -> None:
        if self.ended is None:
            self.ended = _End(code, message)
            self.queue.put_nowait(self.ended)


class _EarlierRefused(GyreError):
    """A batch read ahead of a refused one: dropped with it (the refusal already ended the stream)."""


INGEST_AHEAD = 8
"""Batches of one stream handed to the ingest thread and not yet recorded before the hub reads no further
(gRPC's flow control then holds the sender): enough that the hop to the ingest thread and back is not paid
once per batch in turn, few enough that a stream cannot queue unbounded work."""


def lane_of(hello: Hello) -> str:
    """The lane a hello opens ("": the events lane; a cell has only that one)."""
    return hello.lane if isinstance(hello, gyre_pb2.ProxyHello) else EVENTS_LANE


def lanes_of(hello: Hello) -> tuple[str, ...]:
    """Every lane the process opens (its hello's ``lanes``), the events lane first."""
    extra = hello.lanes if isinstance(hello, gyre_pb2.ProxyHello) else ()
    return (EVENTS_LANE, *sorted(set(extra) - {EVENTS_LANE}))


@dataclass
class _Peer:
    """One incarnation of a process, over its streams keyed by lane (a cell: one; the proxy: events, commands)."""

    kind: str
    peer_id: str
    hello: Hello
    streams: dict[str, _Stream] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)
    """When anything last arrived on each attached lane, on the hub's clock (set as it attaches)."""
    gone: dict[str, tuple[float, str]] = field(default_factory=dict)
    """Each lane not attached: since when (on the hub's clock) and why it ended ("": it never connected)."""
    pending: dict[int, tuple[Command, concurrent.futures.Future[gyre_pb2.CommandDone]]] = field(default_factory=dict)
    plans: dict[int, gyre_pb2.WeightsAnswer] = field(default_factory=dict)
    """Its ToRollouts not yet done that carry a plan, by command_id: the answer it last got for each."""
    lost: str | None = None
    stopped: bool = False  # it has done a Stop command: its streams' end is its exit, not a loss
    ingest: asyncio.Future[int] | None = None  # its last batch handed to the ingest thread

    @property
    def name(self) -> str:
        return f"{self.kind} {self.peer_id}"

    @property
    def lanes(self) -> tuple[str, ...]:
        return lanes_of(self.hello)

    @property
    def command_lane(self) -> str:
        """Where its commands go down (and their dones come up)."""
        return COMMANDS_LANE if COMMANDS_LANE in self.lanes else EVENTS_LANE

    @property
    def connected(self) -> bool:
        """Every lane it opens is attached."""
        return all(lane in self.streams for lane in self.lanes)

    @property
    def last_seen(self) -> float:
        """When anything last arrived on its most silent attached lane (0: none attached)."""
        return min(self.seen.values(), default=0.0)


class Hub:
    """The controller's gRPC server for cells, the proxy and Admin (see the module docstring)."""

    def __init__(self, sink: LogSink, *, run_id: str, secret: str, host: str = "127.0.0.1", port: int = 0,
                 heartbeat_s: float = 1.0, dead_after_s: float = 10.0,
                 status: Callable[[], gyre_pb2.StatusReply] | None = None, advertise: str = "",
                 log_path: Path | None = None, tls: TlsSection | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``host`` is bound; ``advertise`` (default ``host``) is what `start` returns for peers to dial;
        ``log_path``: the run's log, served to processes on other hosts (the Log service); ``clock``: what
        ages a peer's silence, in seconds (tests of lost peers drive it by hand)."""
        if dead_after_s <= heartbeat_s:
            raise ValueError(f"dead_after_s ({dead_after_s}) must exceed heartbeat_s ({heartbeat_s}): "
                             "a peer would be declared lost between two heartbeats")
        self.sink = sink
        self.run_id = run_id
        self.host = host
        self.advertise = advertise or host
        self.port = port
        self.log_path = log_path
        self.tls = tls
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.status = status
        self._clock = clock
        self.received: collections.Counter[str] = collections.Counter()
        """Messages read from the peers' streams after their hellos, by kind (events, done, heartbeat)."""
        self.sweeps = 0
        """Passes the monitor has made over the peers (each declares lost those silent for ``dead_after_s``)."""
        self.on_cell_hello: Callable[[gyre_pb2.CellHello], None] | None = None
        self.on_cell_lost: Callable[[str, str], None] | None = None
        self.on_proxy_hello: Callable[[gyre_pb2.ProxyHello], None] | None = None
        self.on_proxy_lost: Callable[[str], None] | None = None
        self.on_weights_ask: Callable[[str, str], tuple[bool, gyre_pb2.WeightsRef]] | None = None
        """A cell's `WeightsAsk` (cell_id, incarnation) -> whether its engine lacks the latest weights the log
        names, and those weights. Called on the hub's loop: it must be quick and never block on the hub."""
        self._interceptor = SecretInterceptor(secret)
        self._thread = LoopThread("gyre-hub")
        self._ingest = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gyre-hub-ingest")
        self._server: grpc.aio.Server | None = None
        self._peers: dict[Key, _Peer] = {}
        self._lost: dict[tuple[Key, str], str] = {}
        self._cond = threading.Condition()
        # command ids start at the clock (µs): a link that outlives a controller restart never sees one repeated
        self._ids = itertools.count(time.time_ns() // 1000)
        self._outbox: collections.deque[tuple[Key, Command, concurrent.futures.Future[gyre_pb2.CommandDone], str,
                                              int | None]] = collections.deque()
        self._outbox_woken = False
        self._plans_woken = False
        self._plans_epoch = 0
        """Counts `weights_changed` calls: a plan read on a caller's thread is kept only if none came since."""
        self._epoch_lock = threading.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._running = False
        self._stopping = False
        self.address = ""

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> str:
        """Bind and serve; returns ``host:port`` (the bound port when ``port`` was 0)."""
        self._thread.start()
        try:
            self.address = self._thread.submit(self._start()).result(timeout=30)
        except BaseException:
            self._thread.stop()
            raise
        self._running = True
        return self.address

    async def _start(self) -> str:
        server = grpc.aio.server(interceptors=[self._interceptor], options=SERVER_OPTIONS)
        gyre_pb2_grpc.add_CellServicer_to_server(_CellService(self), server)
        gyre_pb2_grpc.add_ProxyServicer_to_server(_ProxyService(self), server)
        gyre_pb2_grpc.add_AdminServicer_to_server(_AdminService(self), server)
        gyre_pb2_grpc.add_LogServicer_to_server(_LogService(self), server)
        try:
            port = add_port(server, f"{bracket(self.host)}:{self.port}", self.tls)
        except RuntimeError as e:
            raise ClusterError(f"the hub cannot listen on {self.host}:{self.port}: {e}") from e
        if port == 0:
            raise ClusterError(f"the hub cannot listen on {self.host}:{self.port} (in use?)")
        await server.start()
        self._server = server
        self._spawn(self._monitor())
        return f"{bracket(self.advertise)}:{port}"

    def stop(self) -> None:
        """Stop serving; commands not yet done fail with `ClusterError`. Does not close the sink. Idempotent."""
        if not self._running:
            return
        self._running = False
        self._thread.submit(self._stop()).result(timeout=30)
        self._thread.stop()
        self._fail_outbox()

    async def _stop(self) -> None:
        self._stopping = True
        for peer in self._peers.values():
            for command_id, (_, future) in peer.pending.items():
                _fail(future, ClusterError(f"the hub stopped before {peer.name} finished command {command_id}"))
            peer.pending.clear()
            for stream in list(peer.streams.values()):  # ended by hand: the server's stop then waits for no handler
                stream.end(grpc.StatusCode.UNAVAILABLE, f"the controller at {self.address} is stopping")
        if self._server is not None:
            await self._server.stop(grace=0.5)
        for task in list(self._tasks):
            task.cancel()
        self._ingest.shutdown(wait=False)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- queries (any thread) ------------------------------------------------------------------------------

    def connected(self, cell_id: str) -> bool:
        with self._cond:
            return self._live(("cell", cell_id))

    def proxy_connected(self) -> bool:
        with self._cond:
            return self._live(("proxy", ""))

    def is_lost(self, kind: str, peer_id: str, incarnation: str) -> bool:
        """Whether that incarnation of a peer was declared lost (a command to it failed for that reason)."""
        key: Key = ("cell", peer_id) if kind == "cell" else ("proxy", "")
        with self._cond:
            return (key, incarnation) in self._lost

    def heartbeat_age(self, cell_id: str) -> float | None:
        """Seconds since anything last arrived from the cell (None: it never connected)."""
        with self._cond:
            peer = self._peers.get(("cell", cell_id))
            return None if peer is None else self._clock() - peer.last_seen

    def wait_for(self, cell_ids: Iterable[str], proxy: bool, timeout_s: float) -> None:
        """Block until every named cell (and the proxy, if ``proxy``) is connected; else `TimeoutError`."""
        if self._thread.here:
            raise RuntimeError("Hub.wait_for was called on the hub's own loop thread (from a callback?): "
                               "it would wait forever")
        keys = [("cell", c) for c in cell_ids] + ([("proxy", "")] if proxy else [])
        with self._cond:
            if self._cond.wait_for(lambda: all(self._live(k) for k in keys), timeout_s):
                return
            missing = [("the proxy" if k[0] == "proxy" else f"cell {k[1]!r}") for k in keys if not self._live(k)]
        raise TimeoutError(f"not connected to the hub at {self.address} after {timeout_s} s: {', '.join(missing)}")

    def _live(self, key: Key) -> bool:
        peer = self._peers.get(key)
        return peer is not None and peer.connected and peer.lost is None

    # -- commands (any thread) -----------------------------------------------------------------------------

    def command_cell(self, cell_id: str, command: gyre_pb2.CellCommand, *, incarnation: str = ""
                     ) -> concurrent.futures.Future[gyre_pb2.CommandDone]:
        """Send ``command`` (a copy, given the next command_id) to a cell; the future gets its `CommandDone`.
        With ``incarnation``, only to that process: another incarnation of the cell fails it with `PeerLost`
        (a decision made for a process never reaches its replacement)."""
        return self._command(("cell", cell_id), command, gyre_pb2.CellCommand(), incarnation)

    def command_proxy(self, command: gyre_pb2.ProxyCommand) -> concurrent.futures.Future[gyre_pb2.CommandDone]:
        """Send ``command`` (a copy, given the next command_id) to the proxy."""
        return self._command(("proxy", ""), command, gyre_pb2.ProxyCommand())

    def _command(self, key: Key, command: Command, copy: Command,
                 incarnation: str = "") -> concurrent.futures.Future[gyre_pb2.CommandDone]:
        """Hand the command to the loop through the outbox: a deque append, and one wake-up per burst.

        The loop numbers what it takes from the outbox in order, so a peer gets its commands in command_id order
        without a lock. (Numbered under a lock held across the wake-up's pipe write, a publish's ~200 actuator
        threads queued on that lock, each hand-over a GIL switch: 40-77 ms median, 190-290 ms p99 at 256 cells,
        before the loop even saw the command; `benchmarks/control_plane_bench.py`.)"""
        if command.WhichOneof("body") is None:
            raise ValueError(f"a {type(command).__name__} without a body (serve, pause, ...) says nothing to do")
        copy.CopyFrom(command)
        future: concurrent.futures.Future[gyre_pb2.CommandDone] = concurrent.futures.Future()
        if not self._running:
            _fail(future, ClusterError(f"the hub is not running; a {command.WhichOneof('body')} command was not sent"))
            return future
        epoch = None  # set for a ToRollout that asks, and only for it: its plan is followed (`_plan`)
        if key[0] == "cell" and copy.WhichOneof("body") == "to_rollout" and copy.to_rollout.ask:
            epoch = self._plans_epoch  # read before the plan: a change after it is seen on the loop (`_plan`)
            known = self._peers.get(key)  # (a read from the caller's thread: the plan is checked again on the loop)
            answer = self._answer(key[1], incarnation or (known.hello.incarnation if known is not None else ""),
                                  gyre_pb2.WeightsAsk())
            if not answer.error:  # read here, not in the loop's drain: ~127 at once in a step end's wave
                copy.to_rollout.plan.CopyFrom(answer)
        self._outbox.append((key, copy, future, incarnation, epoch))
        if not self._outbox_woken:  # a wake-up pending takes this one too (the loop clears the flag, then drains)
            self._outbox_woken = True
            self._thread.call(self._send_outbox)
        if not self._running:  # stopped meanwhile: the loop may be gone, so nothing would drain it
            self._fail_outbox()
        return future

    def _send_outbox(self) -> None:
        """(The loop.) Number each command handed over, in order, and queue it on its peer's stream."""
        self._outbox_woken = False
        while self._outbox:
            try:
                key, command, future, incarnation, epoch = self._outbox.popleft()
            except IndexError:  # taken by `_fail_outbox` as the hub stopped
                return
            command.command_id = next(self._ids)
            self._enqueue(key, command, future, incarnation, epoch)

    def _fail_outbox(self) -> None:
        """Fail what was handed over but never numbered (the hub stopped first)."""
        while True:
            try:
                _, command, future, _, _ = self._outbox.popleft()
            except IndexError:
                return
            _fail(future, ClusterError(f"the hub stopped; a {command.WhichOneof('body')} command was not sent"))

    def _enqueue(self, key: Key, command: Command, future: concurrent.futures.Future[gyre_pb2.CommandDone],
                 incarnation: str = "", epoch: int | None = None) -> None:
        peer = self._peers.get(key)
        what = "the proxy" if key[0] == "proxy" else f"cell {key[1]!r}"
        if self._stopping:
            _fail(future, ClusterError(f"the hub stopped; command {command.command_id} to {what} was not sent"))
        elif peer is None:
            _fail(future, ClusterError(f"{what} has not connected to the hub; command {command.command_id} "
                                       f"({command.WhichOneof('body')}) was not sent"))
        elif peer.lost is not None:
            _fail(future, PeerLost(f"{peer.name} was lost ({peer.lost}); command {command.command_id} "
                                       f"({command.WhichOneof('body')}) was not sent"))
        elif incarnation and peer.hello.incarnation != incarnation:  # fenced: sent for a process now replaced
            _fail(future, PeerLost(f"{peer.name} incarnation {incarnation!r} was replaced by "
                                   f"{peer.hello.incarnation!r}; command {command.command_id} "
                                   f"({command.WhichOneof('body')}) was not sent"))
        else:
            peer.pending[command.command_id] = (command, future)
            if epoch is not None:
                self._plan(peer, command, epoch)
            stream = peer.streams.get(peer.command_lane)
            if stream is not None:
                stream.send(_down(peer.kind, command=command))

    def _plan(self, peer: _Peer, command: gyre_pb2.CellCommand, epoch: int) -> None:
        """(The loop.) Follow the ToRollout's plan (`ToRollout.plan`, the ask's answer) until its done. The plan read
        on the caller's thread stands when no `weights_changed` came since ``epoch`` was read before it; else it
        is read again here. Either way a change after the read reaches `_push_plans` after this: its call comes
        after its state changed and counts the epoch before it schedules the pass. No plan when there is no
        answer (the cell asks, and gets the error then)."""
        if epoch != self._plans_epoch:
            command.to_rollout.ClearField("plan")
            answer = self._answer(peer.peer_id, peer.hello.incarnation, gyre_pb2.WeightsAsk())
            if not answer.error:
                command.to_rollout.plan.CopyFrom(answer)
        if command.to_rollout.HasField("plan"):
            peer.plans[command.command_id] = command.to_rollout.plan

    def weights_changed(self) -> None:
        """(Any thread.) The answer to a weights ask may have changed — the log names a newer version, the core
        offered a copy, the core was lost: each ToRollout still following its plan gets the new answer if it
        differs. Coalesced: one pass on the loop for every call made before it starts."""
        with self._epoch_lock:  # (an increment lost to a race could equal the epoch a plan was read at)
            self._plans_epoch += 1
        if not self._running or self._plans_woken:
            return
        self._plans_woken = True
        self._thread.call(self._push_plans)

    def _push_plans(self, only: _Peer | None = None, *, again: bool = False) -> None:
        """(The loop.) Send each followed plan whose answer changed (``again``: every one, to a reconnected
        ``only``)."""
        if only is None:
            self._plans_woken = False
        for peer in [only] if only is not None else list(self._peers.values()):
            if not peer.plans or peer.lost is not None:
                continue
            answer = self._answer(peer.peer_id, peer.hello.incarnation, gyre_pb2.WeightsAsk())  # one per cell
            if answer.error:
                continue
            stream = peer.streams.get(peer.command_lane)
            for command_id, sent in list(peer.plans.items()):
                if answer == sent and not again:
                    continue
                peer.plans[command_id] = answer
                if stream is not None:
                    stream.send(_down("cell", weights=gyre_pb2.WeightsAnswer(
                        command_id=command_id, load=answer.load, weights=answer.weights)))

    def lose(self, kind: str, peer_id: str, reason: str, incarnation: str = "") -> None:
        """Declare a peer's current incarnation (``incarnation``, if given: only that one) lost now (its
        process was seen to exit, or stopped doing its commands), without waiting ``dead_after_s``; a no-op
        if it is already lost or never connected."""
        key: Key = ("cell", peer_id) if kind == "cell" else ("proxy", "")

        async def lose() -> None:
            peer = self._peers.get(key)
            if peer is not None and incarnation in ("", peer.hello.incarnation):
                self._declare_lost(peer, reason)
        if self._running:
            self._thread.submit(lose()).result(timeout=10)

    # -- test hooks ----------------------------------------------------------------------------------------

    def drop(self, peer_id: str) -> None:
        """End a peer's current stream as a broken network would (tests of reconnects); the peer may come back."""
        async def drop() -> None:
            for peer in self._peers.values():
                if peer.peer_id == peer_id:
                    for stream in list(peer.streams.values()):
                        stream.end(grpc.StatusCode.UNAVAILABLE, f"the hub dropped {peer.name}'s stream")
        self._thread.submit(drop()).result(timeout=10)

    def swept(self, timeout_s: float = 10.0) -> None:
        """Block until the monitor has made a whole pass over the peers begun after this call (tests of lost
        peers: what the clock said by now has been acted on); `TimeoutError` after ``timeout_s``."""
        with self._cond:
            target = self.sweeps + 2  # the pass under way may have read the clock before this call
            if not self._cond.wait_for(lambda: self.sweeps >= target, timeout_s):
                raise TimeoutError(f"the hub's monitor made no pass within {timeout_s} s")

    # -- streams (the loop thread) -------------------------------------------------------------------------

    async def _connect(self, kind: str, context: grpc.aio.ServicerContext) -> None:
        try:
            first = await asyncio.wait_for(context.read(), self.dead_after_s)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"no hello on the {kind} stream within {self.dead_after_s} s")
        if first is grpc.aio.EOF:
            return
        body = first.WhichOneof("body")
        if body != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the first message on a {kind} stream must be hello, got {body or 'an empty message'}")
        hello: Hello = first.hello
        peer_id = hello.cell_id if kind == "cell" else hello.proxy_id
        if not peer_id or not hello.incarnation:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"a {kind} hello must name its {'cell_id' if kind == 'cell' else 'proxy_id'} "
                                f"and incarnation (got {peer_id!r}, {hello.incarnation!r})")
        lane = lane_of(hello)
        if lane not in lanes_of(hello):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{kind} {peer_id} opens lane {lane!r}, which its hello's lanes "
                                f"{list(lanes_of(hello))} do not name")
        if lane != EVENTS_LANE and hello.producers:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{kind} {peer_id}'s {lane} lane names producers {list(hello.producers)}: only its "
                                "events lane records (one stream numbers a producer)")
        key: Key = ("cell", peer_id) if kind == "cell" else ("proxy", "")
        known = self._peers.get(key)
        if (known is not None and known.lost is None and known.hello.incarnation == hello.incarnation
                and lanes_of(known.hello) != lanes_of(hello)):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{kind} {peer_id} incarnation {hello.incarnation!r} named lanes "
                                f"{list(lanes_of(known.hello))}, and now {list(lanes_of(hello))}")
        for other_key, other in self._peers.items():
            shared = set(other.hello.producers) & set(hello.producers)
            if other_key != key and other.lost is None and shared:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{kind} {peer_id} names producers {sorted(shared)}, which {other.name} records "
                                    "as: two processes numbering one producer would drop each other's events")
        lost = self._lost.get((key, hello.incarnation))
        if lost is not None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{kind} {peer_id!r} incarnation {hello.incarnation!r} was declared lost ({lost}); "
                                "a lost process does not come back: restart it")
        previous = self._peers.get(key)
        while (lane == EVENTS_LANE and previous is not None and previous.ingest is not None
               and not previous.ingest.done()):
            await asyncio.wait([previous.ingest])  # the Welcome's positions must follow what it sent
        stream = _Stream(hello)  # (no await from here to the attach: the old stream sends nothing in between)
        peer = self._attach(key, kind, peer_id, hello, stream)
        reader = asyncio.get_running_loop().create_task(self._read(peer, stream, context))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, _End):
                    if item.code is not None:
                        await context.abort(item.code, item.message)
                    return
                await context.write(item)
        finally:
            reader.cancel()
            self._detach(peer, stream)

    def _attach(self, key: Key, kind: str, peer_id: str, hello: Hello, stream: _Stream) -> _Peer:
        peer = self._peers.get(key)
        fresh = peer is None or peer.lost is not None or peer.hello.incarnation != hello.incarnation
        if peer is not None and peer.lost is None and fresh:
            self._declare_lost(peer, f"replaced by incarnation {hello.incarnation!r}")
        lane = stream.lane
        if fresh:
            peer = _Peer(kind, peer_id, hello)
        else:
            assert peer is not None
            if lane == EVENTS_LANE:
                peer.hello = hello  # the hello naming the producers
            replaced = peer.streams.get(lane)
            if replaced is not None:
                replaced.end(grpc.StatusCode.ABORTED, f"{peer.name} connected again: this stream is replaced")
        assert peer is not None
        with self._cond:
            self._peers[key] = peer
            now = self._clock()
            peer.streams[lane] = stream
            peer.seen[lane] = now
            peer.gone.pop(lane, None)
            for other in peer.lanes:  # a lane that never connects is lost as one that ended
                if other not in peer.streams:
                    peer.gone.setdefault(other, (now, ""))
            self._cond.notify_all()
        held = {p: self.sink.held(p) for p in hello.producers}
        stream.send(_down(kind, welcome=gyre_pb2.Welcome(run_id=self.run_id, held=held, heartbeat_s=self.heartbeat_s)))
        if lane == peer.command_lane:
            for command_id in sorted(peer.pending):
                stream.send(_down(kind, command=peer.pending[command_id][0]))
            self._push_plans(peer, again=True)  # what went down the old stream since may be lost
        log.info("%s connected (incarnation %s%s%s)", peer.name, hello.incarnation, f", lane {lane}" if lane else "",
                 "" if fresh else ", again")
        if fresh:
            if kind == "cell":
                self._callback("on_cell_hello", self.on_cell_hello, hello)
            else:
                self._callback("on_proxy_hello", self.on_proxy_hello, hello)
        return peer

    def _detach(self, peer: _Peer, stream: _Stream) -> None:
        reason = stream.ended.message if stream.ended is not None else "the call ended"
        with self._cond:
            if peer.streams.get(stream.lane) is not stream:
                return
            del peer.streams[stream.lane]
            peer.seen.pop(stream.lane, None)
            peer.gone[stream.lane] = (self._clock(), reason)
            self._cond.notify_all()
        if self._stopping:
            return
        log.info("%s stream ended%s: %s", peer.name, f" (lane {stream.lane})" if stream.lane else "", reason)
        if peer.stopped and not peer.streams:
            self._declare_lost(peer, "it stopped (its Stop command is done) and ended its stream")

    async def _read(self, peer: _Peer, stream: _Stream, context: grpc.aio.ServicerContext) -> None:
        """Read the stream. A batch goes to the ingest thread and the next message is read at once (up to
        `INGEST_AHEAD` batches of a stream in flight); a done waits for the batches before it to be recorded, so
        what a stream says still takes effect in the order it was sent."""
        in_flight: collections.deque[asyncio.Future[int]] = collections.deque()
        try:
            while stream.ended is None:
                while in_flight and in_flight[0].done():
                    in_flight.popleft()
                if len(in_flight) >= INGEST_AHEAD:
                    await asyncio.wait([in_flight[0]])
                    continue
                message = await context.read()
                if message is grpc.aio.EOF:  # a close, or a cancelled call: the server cannot tell them apart
                    if stream.ingest is not None and not stream.ingest.done():  # its last dones take effect first
                        await asyncio.wait([stream.ingest])
                    stream.end(None, f"{peer.name} ended its stream")
                    return
                if stream.ended is not None:
                    return
                if peer.streams.get(stream.lane) is stream:
                    peer.seen[stream.lane] = self._clock()
                body = message.WhichOneof("body")
                self.received[body] += 1
                if body == "heartbeat":
                    continue
                if body == "ask" and peer.kind == "cell":
                    stream.send(_down("cell", weights=self._answer(peer.peer_id, peer.hello.incarnation, message.ask)))
                elif body == "events":
                    ingest = self._on_events(peer, stream, message.events)
                    if ingest is not None:
                        in_flight.append(ingest)
                elif body == "done":
                    self._after_ingest(peer, stream, message.done)
                else:
                    stream.end(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{peer.name} sent {body or 'an empty message'} after its hello")
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:  # the hub ended the call itself; the read just learnt it
            return
        except grpc.aio.AioRpcError as e:
            stream.end(None, f"reading from {peer.name} failed: {e.code().name} {e.details()}")
        except Exception as e:  # a bug here must end the stream loudly, not leave it half-served
            log.exception("reading %s's stream failed", peer.name)
            stream.end(grpc.StatusCode.INTERNAL, f"the hub failed on {peer.name}'s stream: {e!r}")

    def _answer(self, cell_id: str, incarnation: str, ask: gyre_pb2.WeightsAsk) -> gyre_pb2.WeightsAnswer:
        """The weights a cell's engine should load now, as the log names them at this moment (the cell asks
        mid-command, after a leave during which the core may have published; any thread)."""
        answer = gyre_pb2.WeightsAnswer(ask_id=ask.ask_id)
        if self.on_weights_ask is None:
            answer.error = "this controller answers no weights asks"
            return answer
        try:
            load, weights = self.on_weights_ask(cell_id, incarnation)
        except Exception as e:  # the controller's bug: the cell's command fails with it, the stream goes on
            log.exception("answering cell %s's weights ask failed", cell_id)
            answer.error = f"the controller could not answer: {e!r}"
            return answer
        answer.load = load
        answer.weights.CopyFrom(weights)
        return answer

    def _on_events(self, peer: _Peer, stream: _Stream, batch: gyre_pb2.EventBatch) -> asyncio.Future[int] | None:
        """Hand the batch to the ingest thread (in arrival order: it is one thread); acknowledged or refused
        when recorded. None when the hub is stopping."""
        try:
            ingest = asyncio.get_running_loop().run_in_executor(self._ingest, self._record, peer, stream, batch)
        except RuntimeError:  # the ingest thread was shut down: the hub is stopping
            if self._stopping:
                return None
            raise
        peer.ingest = stream.ingest = ingest
        ingest.add_done_callback(lambda _: self._recorded(peer, stream, batch, ingest))
        return ingest

    def _recorded(self, peer: _Peer, stream: _Stream, batch: gyre_pb2.EventBatch, ingest: asyncio.Future[int]) -> None:
        if ingest.cancelled():
            return
        error = ingest.exception()
        if isinstance(error, RuntimeError) and self._stopping:
            return
        if isinstance(error, (GyreError, ValueError)):  # a gap, unstamped events, a closed log, a bad batch
            if not isinstance(error, _EarlierRefused):
                self._refuse(peer, stream, batch.batch_id, f"{type(error).__name__}: {error}")
            return
        if error is not None:  # a bug: the stream ends loudly
            log.error("recording %s's batch %d failed", peer.name, batch.batch_id, exc_info=error)
            stream.end(grpc.StatusCode.INTERNAL, f"the hub failed on {peer.name}'s batch {batch.batch_id}: {error!r}")
            return
        position = ingest.result()
        if batch.wait:
            self._spawn(self._ack_durable(peer, stream, batch.batch_id, position))
        else:
            stream.send(_down(peer.kind, ack=gyre_pb2.EventAck(batch_id=batch.batch_id, position=position)))

    def _after_ingest(self, peer: _Peer, stream: _Stream, done: gyre_pb2.CommandDone) -> None:
        """Resolve ``done`` once the batches the stream sent before it are recorded (at once if they are): a
        command's events are in the log before its caller learns it is done. Not after a refused batch (the
        stream ends there, as if nothing after it had been read). Only that stream's: a done up a commands lane
        waits for no batch of the events lane (its process sends it once its command's events are durable)."""
        ingest = stream.ingest
        if ingest is None or ingest.done():
            if not stream.refused:
                self._on_done(peer, done)
            return
        ingest.add_done_callback(lambda _: None if stream.refused else self._on_done(peer, done))

    def _record(self, peer: _Peer, stream: _Stream, batch: gyre_pb2.EventBatch) -> int:
        """Check and record one batch (on the ingest thread); its position in the log. A peer declared lost
        meanwhile is refused, as it would have been on the loop, and so is every batch after a refused one on
        the same stream (read ahead, they were handed over before the refusal ended the stream).

        The batch goes to the log as the producer built it (columnar ingest): no row becomes an event object.
        Its events were validated by their models where they were made (a `Producer` records only events);
        the writer checks the batch's columns and types."""
        if stream.refused:
            raise _EarlierRefused(f"an earlier batch of {peer.name}'s stream was refused")
        try:
            batches = unpack_batches(batch.arrow_ipc)
            if peer.lost is not None:
                raise GyreError(f"{peer.name} was declared lost ({peer.lost})")
            for arrived in batches:
                self._check_stamps(peer, stream, arrived)
            position = self.sink.writer.next_seq - 1
            for arrived in batches:
                position = self.sink.record_batch(arrived)
        except BaseException:
            stream.refused = True
            raise
        return position

    def _check_stamps(self, peer: _Peer, stream: _Stream, batch: pa.RecordBatch) -> None:
        named = set(stream.hello.producers)
        names = batch.schema.names
        if "producer" not in names or "producer_seq" not in names:
            unstamped = pa.array(np.zeros(batch.num_rows, dtype=bool))
        else:
            unstamped = pc.or_(pc.is_null(batch.column("producer")), pc.is_null(batch.column("producer_seq")))
        if pc.any(unstamped).as_py():
            index = _first(unstamped)
            raise GyreError(f"event {index} ({batch.column('kind')[index].as_py()}) has no producer stamp: events from "
                            f"{peer.name} must come through a Producer (exactly once needs producer and producer_seq)")
        outside = pc.invert(pc.is_in(batch.column("producer"), value_set=pa.array(sorted(named), pa.string())))
        if pc.any(outside).as_py():
            index = _first(outside)
            lane = f" on its {stream.lane} lane" if stream.lane else ""
            raise GyreError(f"event {index} ({batch.column('kind')[index].as_py()}) comes from producer "
                            f"{batch.column('producer')[index].as_py()!r}, which {peer.name}'s hello{lane} does not "
                            f"name (it names {sorted(named)})")

    async def _ack_durable(self, peer: _Peer, stream: _Stream, batch_id: int, position: int) -> None:
        try:
            await self.sink.durable(position)
        except GyreError as e:
            self._refuse(peer, stream, batch_id, f"not durable: {type(e).__name__}: {e}")
            return
        stream.send(_down(peer.kind, ack=gyre_pb2.EventAck(batch_id=batch_id, position=position, durable=True)))

    def _refuse(self, peer: _Peer, stream: _Stream, batch_id: int, error: str) -> None:
        log.error("refused event batch %d from %s: %s", batch_id, peer.name, error)
        stream.send(_down(peer.kind, ack=gyre_pb2.EventAck(batch_id=batch_id, error=error)))
        stream.end(grpc.StatusCode.FAILED_PRECONDITION, f"event batch {batch_id} was refused: {error}")

    def _on_done(self, peer: _Peer, done: gyre_pb2.CommandDone) -> None:
        entry = peer.pending.pop(done.command_id, None)
        peer.plans.pop(done.command_id, None)
        if entry is None:  # a repeat of one already resolved
            return
        if done.ok and entry[0].WhichOneof("body") == "stop":
            peer.stopped = True
        _resolve(entry[1], done)

    def _declare_lost(self, peer: _Peer, reason: str) -> None:
        if peer.lost is not None or self._stopping:
            return
        with self._cond:
            peer.lost = reason
            self._lost[((peer.kind, peer.peer_id if peer.kind == "cell" else ""), peer.hello.incarnation)] = reason
            self._cond.notify_all()
        for stream in list(peer.streams.values()):
            stream.end(grpc.StatusCode.FAILED_PRECONDITION, f"{peer.name} was declared lost: {reason}")
        log.log(logging.INFO if peer.stopped else logging.WARNING, "%s (incarnation %s) %s: %s", peer.name,
                peer.hello.incarnation, "left" if peer.stopped else "lost", reason)
        pending, peer.pending = peer.pending, {}
        for command_id, (command, future) in sorted(pending.items()):
            _fail(future, PeerLost(f"{peer.name} was lost ({reason}) before command {command_id} "
                                       f"({command.WhichOneof('body')}) was done"))
        if peer.stopped:  # the controller asked it to go: nothing to tell
            return
        if peer.kind == "cell":
            self._callback("on_cell_lost", self.on_cell_lost, peer.peer_id, reason)
        else:
            self._callback("on_proxy_lost", self.on_proxy_lost, peer.peer_id)

    async def _monitor(self) -> None:
        """Declare lost the peers that went quiet, or whose stream ended and did not come back."""
        # at most a second between sweeps, however long the heartbeat period: a silent peer is lost within a
        # second of dead_after_s
        interval = max(0.01, min(self.heartbeat_s, self.dead_after_s / 4, 1.0))
        while True:
            await asyncio.sleep(interval)
            now = self._clock()
            for peer in list(self._peers.values()):
                if peer.lost is not None:
                    continue
                silent = min(peer.seen, key=peer.seen.__getitem__, default=None)  # its most silent lane
                gone = min(peer.gone, key=lambda lane: peer.gone[lane][0], default=None)
                if silent is not None and now - peer.seen[silent] > self.dead_after_s:
                    on = f" on its {silent} lane" if silent else ""
                    self._declare_lost(peer, f"nothing arrived{on} for {now - peer.seen[silent]:.1f} s (heartbeats "
                                             f"every {self.heartbeat_s} s; dead after {self.dead_after_s} s)")
                elif gone is not None and now - peer.gone[gone][0] > self.dead_after_s:
                    stream, why = f"its {gone} lane" if gone else "its stream", peer.gone[gone][1]
                    self._declare_lost(peer, f"{stream} ended ({why}) and it did not reconnect within "
                                             f"{self.dead_after_s} s" if why else
                                       f"{stream} did not connect within {self.dead_after_s} s of its process")
            with self._cond:
                self.sweeps += 1
                self._cond.notify_all()

    def _callback(self, name: str, callback: Callable[..., None] | None, *args: Any) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # the controller's bug: logged with its traceback; the stream keeps serving
            log.exception("Hub.%s%r raised", name, args)

    # -- admin ---------------------------------------------------------------------------------------------

    async def _status(self, context: grpc.aio.ServicerContext) -> gyre_pb2.StatusReply:
        if self.status is None:
            return self._minimal_status()
        try:
            reply = await asyncio.to_thread(self.status)
        except Exception as e:  # reported to the caller as INTERNAL, with the error
            log.exception("the status callback failed")
            await context.abort(grpc.StatusCode.INTERNAL, f"status failed: {e!r}")
        if not reply.run_id:
            reply.run_id = self.run_id
        return reply

    def _minimal_status(self) -> gyre_pb2.StatusReply:
        now = self._clock()
        cells = [gyre_pb2.CellStatus(cell_id=p.peer_id, connected=p.connected and p.lost is None,
                                     is_core=p.hello.is_core, slots=p.hello.slots,
                                     last_heartbeat_age_s=now - p.last_seen)
                 for k, p in sorted(self._peers.items()) if k[0] == "cell"]
        return gyre_pb2.StatusReply(run_id=self.run_id, cells=cells, proxy_connected=self._live(("proxy", "")))


def _first(mask: pa.Array) -> int:
    return int(np.flatnonzero(mask.to_numpy(zero_copy_only=False))[0])


def _down(kind: str, **body: Any) -> gyre_pb2.CellDown | gyre_pb2.ProxyDown:
    return gyre_pb2.CellDown(**body) if kind == "cell" else gyre_pb2.ProxyDown(**body)


def _resolve(future: concurrent.futures.Future[Any], value: Any) -> None:
    try:
        future.set_result(value)
    except concurrent.futures.InvalidStateError:  # the caller cancelled it: nobody waits for the outcome
        return


def _fail(future: concurrent.futures.Future[Any], error: BaseException) -> None:
    try:
        future.set_exception(error)
    except concurrent.futures.InvalidStateError:  # the caller cancelled it: nobody waits for the outcome
        return


class _CellService(gyre_pb2_grpc.CellServicer):
    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    async def Connect(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await self.hub._connect("cell", context)


class _ProxyService(gyre_pb2_grpc.ProxyServicer):
    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    async def Connect(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await self.hub._connect("proxy", context)


class _AdminService(gyre_pb2_grpc.AdminServicer):
    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    async def Status(self, request: gyre_pb2.StatusRequest,
                     context: grpc.aio.ServicerContext) -> gyre_pb2.StatusReply:
        return await self.hub._status(context)


class _LogService(gyre_pb2_grpc.LogServicer):
    """The run's log, batch by batch, for a process that cannot read the controller's disk (the core builds
    its batches from it; a restarted core folds it). A reader thread per call feeds the stream, so a long read
    never stalls the hub's loop; with ``follow`` it tails the log (reading only new bytes) until the call ends."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    async def Read(self, request: gyre_pb2.LogRead, context: grpc.aio.ServicerContext) -> Any:
        if self.hub.log_path is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this controller serves no log")
        reader = LogReader(self.hub.log_path)
        stop = threading.Event()
        batches = (reader.follow(request.from_seq, stop=stop) if request.follow
                   else reader.read(request.from_seq, None if request.to_seq < 0 else request.to_seq))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()

        def pump() -> None:
            item: BaseException | None = None
            try:
                for batch in batches:
                    if stop.is_set():
                        return
                    loop.call_soon_threadsafe(queue.put_nowait, batch_to_ipc(batch))
            except BaseException as error:  # handed to the caller as INTERNAL
                item = error
            finally:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody reads
                    loop.call_soon_threadsafe(queue.put_nowait, item)

        threading.Thread(target=pump, name="gyre-log-read", daemon=True).start()
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    await context.abort(grpc.StatusCode.INTERNAL, f"reading the log failed: {item}")
                yield gyre_pb2.LogChunk(ipc=item)
        finally:
            stop.set()
