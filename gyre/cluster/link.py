"""A process's end of the control plane: one stream to the controller's `Hub`, kept up across breaks.

`ControllerLink` runs the stream on its own thread and event loop. Events go up through `RemoteSink`
(an `EventSink`, so the proxy and the cell record exactly as they would into a local `LogSink`); each record
is kept until the hub acknowledges it durable. A heartbeat goes up once nothing else has for
``Welcome.heartbeat_s`` (any message tells the hub the process lives). When the
stream breaks the link reconnects with jittered exponential backoff, says hello again (the same incarnation)
and re-sends every record not yet acknowledged: the controller's sink drops what it already holds (producer
stamps), so each event lands exactly once.

With a ``spill_dir`` the records the controller has not acknowledged are also kept in a local, fsync'd
`Spill` (`gyre.cluster.spill`) whenever no stream is live, so they count as durable while the controller is
down (callers keep going) and survive a kill of the process: the next incarnation over the same directory
re-sends them first and numbers its producers after them. The controller stays the run's one log writer.

Commands run on one dedicated thread, in the order they arrive (a cell's commands never overlap). Each
command id runs once per process; a repeat (the hub re-sends what was pending when the stream broke) is
answered with the recorded `CommandDone`. The handler returns the command's figures (a mapping, or None),
or a whole `CommandDone` when the command has a ``detail`` to return (ok unless its ``error`` is set), or either
wrapped in `Durable` to have the done go up once what it recorded is durable without holding the command thread;
an exception is reported as ``ok=False`` with its text, and whether it is transient (``retryable``, from its
type: `gyre.cluster.failures`). A cell's command may ask the controller mid-way which weights to load
(`ask_weights`), answered down the same stream.

The proxy opens two links of one incarnation (`EVENTS_LANE`, `COMMANDS_LANE`: `gyre.cluster.proxy_node`); a
command handled on one whose events went up the other answers `Durable` over that other link's sink, ``remote``.

A link that the controller refuses for good — a wrong secret, a protocol error, a refused batch, a process
declared lost — stops: ``error`` says why, ``on_failed`` is told, and the sink's waiters fail with `SinkError`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa

from gyre.cluster.aio import GRPC_OPTIONS, LoopThread
from gyre.cluster.auth import metadata
from gyre.cluster.errors import ClusterError, Unavailable
from gyre.cluster.failures import failed_done
from gyre.cluster.proto import gyre_pb2, gyre_pb2_grpc
from gyre.cluster.spill import Spill
from gyre.cluster.tls import TlsSection, aio_channel
from gyre.errors import GyreError
from gyre.events.codec import check_events
from gyre.events.models import Event
from gyre.events.wire import pack_events
from gyre.sink import Producer, SinkError

log = logging.getLogger(__name__)

Hello = gyre_pb2.CellHello | gyre_pb2.ProxyHello
Command = gyre_pb2.CellCommand | gyre_pb2.ProxyCommand


EVENTS_LANE = ""
COMMANDS_LANE = "commands"
"""A proxy's lanes (`ProxyHello.lanes`): its events go up the first; with the second, its commands come down and
their dones go up there, so a done does not wait behind the model-call batches sent before it (issue 30)."""


@dataclass(frozen=True)
class Durable:
    """A handler's answer whose done goes up only once ``position`` of ``sink`` (None: the link's own) is
    durable — in the controller's log if ``remote`` (a done up another stream than its events': only their
    acknowledgement says the hub recorded them first); the command thread takes the next command meanwhile
    (the proxy's queue waited there for its executions' events to be durable, and every routing and redirect
    behind it waited too)."""

    answer: Mapping[str, float] | gyre_pb2.CommandDone | None
    position: int
    sink: RemoteSink | None = None
    remote: bool = False


Handler = Callable[[Any], Mapping[str, float] | gyre_pb2.CommandDone | Durable | None]

CLIENT_OPTIONS: tuple[tuple[str, int], ...] = (
    *GRPC_OPTIONS,
    ("grpc.keepalive_time_ms", 10_000),  # a silent network partition breaks the call instead of hanging it
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
)

FATAL = {
    grpc.StatusCode.UNAUTHENTICATED: "refused the run secret",
    grpc.StatusCode.PERMISSION_DENIED: "refused this process",
    grpc.StatusCode.INVALID_ARGUMENT: "refused the stream as malformed",
    grpc.StatusCode.FAILED_PRECONDITION: "ended the stream for good",
    grpc.StatusCode.UNIMPLEMENTED: "does not serve this service",
}
"""Endings that another attempt cannot fix: the link stops instead of reconnecting."""


@dataclass
class _Record:
    record_id: int
    events: list[Event]
    last: int  # the local position of the record's last event
    weight: int  # a size estimate (elements of its lists and strings) that bounds one wire batch


def _weight(events: list[Event]) -> int:
    return sum(1 + sum(len(v) for v in e.__dict__.values() if isinstance(v, list | str | bytes)) for e in events)


class RemoteSink:
    """An `EventSink` whose events go to the controller's log over the link's stream.

    Positions are *local*: ``record`` returns the count of events recorded through this sink, minus one.
    They order this sink's events and say what ``commit``/``durable`` wait for; they are not log seqs and
    are comparable only within one sink. Only stamped events are taken (`Producer`, from ``link.producer``).

    Each ``record`` is kept until acknowledged. The link packs on its own thread, not the caller's, and
    coalesces the records waiting to be sent into one wire batch whose ``batch_id`` is its last record's id;
    an acknowledgement covers every record up to it (the hub records a stream's batches in order, and a
    durable position covers everything before it in the log).

    With a `Spill`, a position is durable once the controller acknowledged it *or* it is fsync'd in the
    spill, so callers keep going while the controller is down. While no stream is live every record is
    spilled as it comes; when a stream breaks every unacknowledged record is spilled at once; while one is
    live nothing is (no fsync on the hot path). The spill writer is its own thread (one fsync covers every
    record waiting) and drops what the controller acknowledges. ``remote=True`` waits for the controller.
    """

    BATCH_EVENTS = 4096
    BATCH_WEIGHT = 4 << 20
    """A wire batch holds at most this many events, or records this heavy (~16-32 MB of token lists and
    log-probs) — one heavier record travels alone; gRPC's message limit is 512 MiB here."""

    def __init__(self, producers: Sequence[str], notify: Callable[[], None], spill: Spill | None = None) -> None:
        self._producers = frozenset(producers)
        self._notify = notify
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._count = 0
        self._next_record = 1
        self._unacked: dict[int, _Record] = {}  # in record id order (ids are assigned under the lock)
        self._durable_record = 0
        self._acked = -1  # the last position the controller acknowledged durable
        self._durable = -1  # max(acked, spilled): what local waiters wait for
        self._waiters: list[tuple[int, bool, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._error: SinkError | None = None
        self._closed = False
        self._spill = spill
        self._online = False  # whether the link has a live stream (else: records are spilled as they come)
        self._spill_cond = threading.Condition(self._lock)
        self._spill_target = 0  # every record up to this id is to be acked or spilled
        self._spill_written = 0  # every record up to this id is acked or spilled
        self._drop_target = 0  # the controller holds the records up to this id
        self._spill_dropped = 0
        self._spill_broken = False  # a spill write failed: waiters wait for the controller again
        self._spill_stop: str | None = None  # "close": finish what is due, then stop; "kill": stop now
        self._spilled_seqs: dict[str, int] = {}
        self._spill_thread: threading.Thread | None = None
        if spill is not None:
            self._load(spill)
            self._spill_thread = threading.Thread(target=self._spill_loop, name="gyre-spill", daemon=True)
            self._spill_thread.start()

    def _load(self, spill: Spill) -> None:
        """Take over what a previous incarnation spilled: re-sent first, durable already."""
        for spilled in spill.load():
            self._check(spilled.events)
            self._count += len(spilled.events)
            self._unacked[spilled.record_id] = _Record(spilled.record_id, spilled.events, self._count - 1,
                                                       _weight(spilled.events))
            for event in spilled.events:
                assert event.producer is not None and event.producer_seq is not None
                self._spilled_seqs[event.producer] = max(event.producer_seq,
                                                         self._spilled_seqs.get(event.producer, -1))
        last = max(spill.last_id, *self._unacked) if self._unacked else spill.last_id
        self._next_record = last + 1
        self._spill_target = self._spill_written = last
        self._durable = self._count - 1

    def spilled_seq(self, producer_id: str) -> int:
        """The last producer_seq of ``producer_id`` that the spill held when this sink took it over (-1: none)."""
        return self._spilled_seqs.get(producer_id, -1)

    def record(self, events: Event | Sequence[Event]) -> int:
        batch = check_events([events] if isinstance(events, Event) else list(events))
        self._check(batch)
        now = datetime.now(UTC)  # stamped once, here: a re-sent (re-packed) record keeps its time
        batch = [e if e.ts is not None else e.model_copy(update={"ts": now}) for e in batch]
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._closed:
                raise SinkError("the remote sink is closed")
            if not batch:
                return self._count - 1
            self._count += len(batch)
            entry = _Record(self._next_record, batch, self._count - 1, _weight(batch))
            self._next_record += 1
            self._unacked[entry.record_id] = entry
            if self._spill is not None and not self._online:
                self._spill_target = entry.record_id
                self._spill_cond.notify()
        self._notify()
        return entry.last

    def _check(self, batch: list[Event]) -> None:
        for index, event in enumerate(batch):
            if event.producer is None or event.producer_seq is None:
                raise SinkError(f"event {index} ({event.kind}) has no producer stamp: record through a Producer "
                                "(ControllerLink.producer), exactly once across reconnects needs the stamps")
            if event.producer not in self._producers:
                raise SinkError(f"event {index} ({event.kind}) comes from producer {event.producer!r}, which this "
                                f"link's hello does not name (it names {sorted(self._producers)})")

    def commit(self, position: int | None = None, *, remote: bool = False, timeout_s: float | None = None) -> None:
        """Block until ``position`` (default: all recorded) is durable — in the controller's log if ``remote``.

        `TimeoutError` after ``timeout_s``; the sink's `SinkError` if the link failed before.
        """
        with self._cond:
            target = self._count - 1 if position is None else self._known(position)
            self._cond.wait_for(lambda: self._level(remote) >= target or self._error is not None, timeout_s)
            if self._level(remote) >= target:
                return
            if self._error is not None:
                raise self._error
        raise TimeoutError(f"position {target} was not durable{' in the controller' if remote else ''} "
                           f"within {timeout_s} s")

    async def durable(self, position: int, *, remote: bool = False) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._known(position)
            if self._level(remote) >= position:
                return
            if self._error is not None:
                raise self._error
            self._waiters.append((position, remote, loop, future))
        await future

    def _level(self, remote: bool) -> int:
        return self._acked if remote else self._durable

    def _known(self, position: int) -> int:
        if position >= self._count:
            raise ValueError(f"position {position} was never returned by this sink (it has recorded {self._count} "
                             "events; positions are local to one RemoteSink, not log seqs)")
        return position

    def close(self) -> None:
        """Wait until everything recorded is durable in the controller's log, then refuse more. Idempotent."""
        if self._error is None:
            self.commit(remote=True)
        with self._lock:
            self._closed = True

    def _ready(self) -> list[tuple[int, bool, asyncio.AbstractEventLoop, asyncio.Future[None]]]:
        """Take the waiters whose position is now durable (under the lock)."""
        ready = [w for w in self._waiters if w[0] <= self._level(w[1])]
        if ready:
            self._waiters = [w for w in self._waiters if w[0] > self._level(w[1])]
        return ready

    # -- the link's side (its loop thread) -----------------------------------------------------------------

    def _batches(self, after: int) -> list[list[_Record]]:
        """The records after record id ``after``, grouped into wire batches, in order."""
        with self._lock:  # the newest only: a scan of every unacknowledged record made a backlog quadratic
            records = []
            for record_id in reversed(self._unacked):
                if record_id <= after:
                    break
                records.append(self._unacked[record_id])
        records.reverse()
        groups: list[list[_Record]] = []
        events = weight = 0
        for record in records:
            if groups and groups[-1] and (events + len(record.events) > self.BATCH_EVENTS
                                          or weight + record.weight > self.BATCH_WEIGHT):
                groups.append([])
                events = weight = 0
            if not groups:
                groups.append([])
            groups[-1].append(record)
            events += len(record.events)
            weight += record.weight
        return groups

    def _ack(self, ack: gyre_pb2.EventAck) -> None:
        if ack.error:
            self._fail(SinkError(f"the controller refused event batch {ack.batch_id}: {ack.error}"))
            return
        if not ack.durable:
            return
        with self._cond:
            if ack.batch_id <= self._durable_record:
                return  # a repeat: covered already
            if ack.batch_id >= self._next_record:
                log.warning("ignoring an ack of batch %d: only %d records were sent", ack.batch_id,
                            self._next_record - 1)
                return
            while self._unacked and next(iter(self._unacked)) <= ack.batch_id:
                self._acked = self._unacked.pop(next(iter(self._unacked))).last
            self._durable_record = ack.batch_id
            self._durable = max(self._durable, self._acked)
            if self._spill is not None:
                self._drop_target = ack.batch_id
                if self._spill_written > self._spill_dropped:
                    self._spill_cond.notify()
            ready = self._ready()
            self._cond.notify_all()
        for _, _, loop, future in ready:
            _settle(loop, future, None)

    def _fail(self, error: SinkError) -> None:
        with self._cond:
            if self._error is not None:
                return
            self._error = error
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for _, _, loop, future in waiters:
            _settle(loop, future, error)

    def _connected(self, live: bool) -> None:
        """The link got a stream (records go up only) or lost it (spill every unacknowledged record now)."""
        with self._lock:
            self._online = live
            if not live and self._spill is not None and self._error is None:
                self._spill_target = self._next_record - 1
                self._spill_cond.notify()

    # -- the spill writer (its own thread) -----------------------------------------------------------------

    def _spill_due(self) -> tuple[bool, bool]:
        write = self._spill_target > self._spill_written and not self._spill_broken
        drop = self._drop_target > self._spill_dropped and self._spill_written > self._spill_dropped
        return write, drop

    def _spill_loop(self) -> None:
        spill = self._spill
        assert spill is not None
        while True:
            with self._spill_cond:
                self._spill_cond.wait_for(lambda: self._spill_stop is not None or any(self._spill_due()))
                due_write, due_drop = self._spill_due()
                if self._spill_stop == "kill" or not (due_write or due_drop):
                    return
                target, drop = self._spill_target, self._drop_target
                write: list[_Record] = []
                if due_write:  # the unacked records after the written ones: the tail of _unacked
                    for record in reversed(self._unacked.values()):
                        if record.record_id <= self._spill_written:
                            break
                        if record.record_id <= target:
                            write.append(record)
                    write.reverse()
            if write:
                try:
                    spill.append([(r.record_id, r.events) for r in write])
                except (OSError, GyreError, ValueError, pa.ArrowException) as e:
                    log.error("writing the spill %s failed (%r): waiting for the controller again", spill.path, e)
                    with self._lock:
                        self._spill_broken = True
                    continue
            if due_drop:
                try:
                    spill.drop_upto(drop)
                except OSError as e:  # a segment left behind only re-sends events the controller holds
                    log.warning("dropping acknowledged records from the spill %s failed: %r", spill.path, e)
            with self._cond:
                if due_write:
                    self._spill_written = max(self._spill_written, target)
                    if write:
                        self._durable = max(self._durable, write[-1].last)
                if due_drop:
                    self._spill_dropped = max(self._spill_dropped, drop)
                ready = self._ready()
                self._cond.notify_all()
            for _, _, loop, future in ready:
                _settle(loop, future, None)

    def _stop_spill(self, kill: bool = False) -> None:
        """Stop the spill writer — after what is due, or at once (``kill``: as a killed process) — and close it."""
        if self._spill is None:
            return
        with self._lock:
            if self._spill_stop != "kill":
                self._spill_stop = "kill" if kill else "close"
            self._spill_cond.notify()
        if self._spill_thread is not None and self._spill_thread is not threading.current_thread():
            self._spill_thread.join(30)
        self._spill.close()

    @property
    def recorded(self) -> int:
        """The position of the last event recorded so far (-1: none yet)."""
        with self._lock:
            return self._count - 1

    @property
    def unacked(self) -> int:
        """Records sent or waiting to be sent that the controller has not acknowledged durable yet."""
        with self._lock:
            return len(self._unacked)

    @property
    def online(self) -> bool:
        """Whether the link has a live stream to the controller."""
        with self._lock:
            return self._online


class _Conn:
    """One connected call: the messages queued up it, when the last was queued, and the last record it has
    been given."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.last_up = time.monotonic()  # the hello went up just now
        self.sent_upto = 0
        self.window: collections.deque[int] = collections.deque()
        """The batches queued up this call and not yet acknowledged durable, by batch id (`PACK_AHEAD`)."""
        self.broken = False

    def put(self, message: Any) -> None:
        """Queue ``message`` up the call (the loop thread)."""
        self.last_up = time.monotonic()
        self.queue.put_nowait(message)


class _Ended(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


_CLOSE = object()

ASK_TIMEOUT_S = 60.0
"""How long a cell waits for the controller to answer a weights ask (it answers at once from its log's fold;
a stream that breaks fails the ask sooner)."""


PACK_AHEAD = 8
"""Event batches a link has up its call and not yet acknowledged durable; what is recorded while that many are
out waits in the sink and goes as one batch at the next acknowledgement. Keeping up, every record goes at once;
behind (the controller's ingest or log lagging, a burst of records) the batches grow instead of multiplying:
the hub pays ~1 ms of its ingest thread per batch whatever its size, and a done waits for every batch sent
before it. As many as the hub reads ahead (`gyre.cluster.hub.INGEST_AHEAD`): more would sit in gRPC's buffers
unread, a done behind them (at 256 cells the proxy had ~20 small batches queued in a burst, and its command
dones waited 0.1-2 s); fewer makes a done wait for the pack of all that was held back (4 was no better)."""


@dataclass
class _Packed:
    """An event batch in the call's queue: records ``first``..``last``, being packed on the packer thread."""

    first: int
    last: int
    packed: asyncio.Future[bytes]


class ControllerLink:
    """A cell's or the proxy's stream to the controller (see the module docstring)."""

    def __init__(self, address: str, *, secret: str, hello: gyre_pb2.CellHello | gyre_pb2.ProxyHello,
                 handler: Handler | None = None, backoff_s: tuple[float, float] = (0.05, 2.0),
                 connect_timeout_s: float = 30.0, spill_dir: str | Path | None = None,
                 tls: TlsSection | None = None) -> None:
        if isinstance(hello, gyre_pb2.CellHello):
            self.kind, copy = "cell", gyre_pb2.CellHello()
        elif isinstance(hello, gyre_pb2.ProxyHello):
            self.kind, copy = "proxy", gyre_pb2.ProxyHello()
        else:
            raise TypeError(f"hello must be a CellHello or a ProxyHello, not {type(hello).__name__}")
        copy.CopyFrom(hello)
        if not copy.incarnation:
            copy.incarnation = uuid.uuid4().hex
        self.address = address
        self.tls = tls
        self.hello = copy
        self.handler = handler
        self.backoff_s = backoff_s
        self.connect_timeout_s = connect_timeout_s
        self.peer_id = copy.cell_id if self.kind == "cell" else copy.proxy_id
        self.lane = copy.lane if self.kind == "proxy" else EVENTS_LANE
        name = f"{self.peer_id}-{self.lane}" if self.lane else self.peer_id
        self._metadata = metadata(secret)
        self._pump_due = False  # a wake-up to send what was recorded is on its way to the loop
        self.spill = None if spill_dir is None else Spill(spill_dir)
        """The local buffer of unacknowledged events (`gyre.cluster.spill`), or None: they live in memory only."""
        try:
            self.sink = RemoteSink(list(copy.producers), self._notify, spill=self.spill)
        except SinkError as e:  # the previous incarnation recorded as producers this hello does not name
            if self.spill is not None:
                self.spill.close()
            raise ClusterError(f"{self.kind} {self.peer_id!r} cannot take over its spill {spill_dir}: {e}") from e
        self.welcome: gyre_pb2.Welcome | None = None
        self.error: ClusterError | None = None
        self.on_failed: Callable[[ClusterError], None] | None = None
        """Told, on the link's loop thread (it must not block), when the link stops for good."""
        self.connections = 0
        """Streams that reached their Welcome (1 + the reconnects so far)."""
        self.sent: collections.Counter[str] = collections.Counter()
        """Messages written up the stream after its hellos, by kind (events, done, heartbeat)."""
        self._thread = LoopThread(f"gyre-link-{name}")
        self._packer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"gyre-pack-{name}")
        """Packs event batches off the loop; one thread, so they are packed in the order they were queued."""
        self._ready = threading.Event()
        self._producers: dict[str, Producer] = {}
        self._producers_lock = threading.Lock()
        self._commands: queue.Queue[Any] = queue.Queue()
        self._command_thread = threading.Thread(target=self._command_loop, name=f"gyre-commands-{name}",
                                                daemon=True)
        self._done: dict[int, gyre_pb2.CommandDone] = {}
        self._asks = 0
        self._asked: dict[int, tuple[_Conn, asyncio.Future[gyre_pb2.WeightsAnswer]]] = {}  # (the loop)
        self._plans: dict[int, gyre_pb2.WeightsAnswer] = {}  # newer `ToRollout.plan`s, by command (`planned`)
        self._waiting: set[asyncio.Task[None]] = set()  # dones waiting for their events to be durable
        self._deferred = 0  # how many: counted from the command thread, which hands them over
        self._deferred_cond = threading.Condition()
        self._seen: set[int] = set()
        self._conn: _Conn | None = None
        self._run: Any = None
        self._main_task: asyncio.Task[Any] | None = None
        self._closing = False
        self._closed = False
        self._silent = False
        self._last_error = "no attempt yet"

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> gyre_pb2.Welcome:
        """Connect; blocks until the first Welcome. `ClusterError` if refused or none after connect_timeout_s."""
        if self._run is not None:
            raise RuntimeError("ControllerLink.start was called twice")
        self._thread.start()
        self._command_thread.start()
        self._run = self._thread.submit(self._main())
        self._ready.wait(self.connect_timeout_s)
        if self.welcome is None:
            error = self.error or ClusterError(
                f"no Welcome from the controller at {self.address} within {self.connect_timeout_s} s "
                f"({self.kind} {self.peer_id!r}; last error: {self._last_error})")
            self._shutdown()
            raise error
        return self.welcome

    def producer(self, producer_id: str) -> Producer:
        """The `Producer` for ``producer_id`` (one per id and link), continuing after what the log holds from it
        and what this process's spill held (a killed incarnation's events, re-sent first)."""
        if self.welcome is None:
            raise ClusterError("ControllerLink.producer needs the Welcome's positions: call start() first")
        if producer_id not in self.hello.producers:
            raise ValueError(f"producer {producer_id!r} is not named in the hello's producers "
                             f"{list(self.hello.producers)}: the controller tells positions only for those")
        with self._producers_lock:
            if producer_id not in self._producers:
                next_seq = max(self.welcome.held.get(producer_id, -1), self.sink.spilled_seq(producer_id)) + 1
                self._producers[producer_id] = Producer(self.sink, producer_id, next_seq)
            return self._producers[producer_id]

    def close(self, timeout_s: float | None = None) -> None:
        """Flush (wait until the controller holds every recorded event durable), then end the stream and stop.

        ``timeout_s`` bounds the flush: `ClusterError` if the controller has not acknowledged everything by
        then (the link is stopped anyway; with a spill, what is unacknowledged stays in it for the next
        incarnation). A failed link is not flushed: its events cannot become durable. Idempotent.
        """
        if self._closed:
            return
        if self._thread.here:
            raise RuntimeError("ControllerLink.close was called on the link's own loop thread")
        if threading.current_thread() is self._command_thread:
            raise RuntimeError("ControllerLink.close was called from the command handler: the command's "
                               "CommandDone could never go up; close the link once the handler has returned")
        self._closed = True
        flushed: BaseException | None = None
        if self._run is not None and self.error is None:
            flusher = threading.Thread(target=self._flush, daemon=True)
            flusher.start()
            flusher.join(timeout_s)
            if flusher.is_alive():
                kept = "" if self.spill is None else f" (they stay in the spill {self.spill.path})"
                flushed = ClusterError(f"{self.sink.unacked} event batches of {self.kind} {self.peer_id!r} were "
                                       f"not acknowledged durable within {timeout_s} s of close{kept}")
        self._shutdown()
        if flushed is not None:
            raise flushed

    def _flush(self) -> None:
        try:
            self.sink.close()
        except SinkError as e:  # the link failed meanwhile: self.error says why, and close reports nothing more
            log.warning("%s %r closed without flushing: %s", self.kind, self.peer_id, e)

    def _shutdown(self) -> None:
        self._commands.put(None)
        if threading.current_thread() is not self._command_thread and self._command_thread.is_alive():
            self._command_thread.join(10)
        if self._run is not None:
            self._thread.call(self._begin_close)
            try:
                self._run.result(timeout=10)
            except TimeoutError:
                log.warning("%s %r: the stream did not end within 10 s of close", self.kind, self.peer_id)
            except concurrent.futures.CancelledError:  # the loop was stopped under it (sever)
                pass
        self._thread.stop()
        self._packer.shutdown(wait=False)
        self.sink._stop_spill()  # after the stream's end, which spilled what the controller has not acknowledged

    def _begin_close(self) -> None:
        self._closing = True
        if self._conn is not None:
            self._pump(before=True)
            self._conn.queue.put_nowait(_CLOSE)
        elif self._main_task is not None:
            self._main_task.cancel()

    # -- test hooks ----------------------------------------------------------------------------------------

    def stop_heartbeats(self) -> None:
        """Test hook: stop sending heartbeats but keep the stream (a hung process)."""
        self._silent = True

    def sever(self) -> None:
        """Test hook: stop dead, as a killed process would: the call is cut, nothing flushed, no goodbye.

        The spill keeps what it holds and takes nothing more (a killed process spills nothing on its way out).
        """
        self._closed = True
        self.sink._stop_spill(kill=True)
        self._thread.stop()
        self._packer.shutdown(wait=False)
        self._commands.put(None)

    # -- the stream (the loop thread) ----------------------------------------------------------------------

    async def _main(self) -> None:
        self._main_task = asyncio.current_task()
        delay = self.backoff_s[0]
        while not self._closing:
            before = self.connections
            try:
                await self._session()
            except _Ended as e:
                if e.code in FATAL:
                    self._fail(ClusterError(f"the controller at {self.address} {FATAL[e.code]} "
                                            f"({self.kind} {self.peer_id!r}; {e.code.name}: {e.details})"))
                    return
                self._last_error = str(e)
            except asyncio.CancelledError:
                if self._closing:
                    return
                raise
            if self._closing:
                return
            if self.connections > before:  # it was up: start the backoff over
                delay = self.backoff_s[0]
            log.info("%s %r: stream to %s ended (%s); reconnecting in ~%.2f s", self.kind, self.peer_id,
                     self.address, self._last_error, delay)
            try:
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            except asyncio.CancelledError:
                if self._closing:
                    return
                raise
            delay = min(delay * 2, self.backoff_s[1])

    async def _session(self) -> None:
        """One call: hello, Welcome, then serve until it ends (`_Ended` unless the link closed it)."""
        async with aio_channel(self.address, self.tls, CLIENT_OPTIONS) as channel:
            stub = gyre_pb2_grpc.CellStub(channel) if self.kind == "cell" else gyre_pb2_grpc.ProxyStub(channel)
            call = stub.Connect(metadata=self._metadata)
            conn: _Conn | None = None
            try:
                try:
                    async with asyncio.timeout(self.connect_timeout_s):  # a hung controller must not hold a retry
                        await self._io(call, call.write(self._up(hello=self.hello)))
                        first = await self._io(call, call.read())
                except TimeoutError:
                    raise _Ended(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"no Welcome within {self.connect_timeout_s} s of hello") from None
                if first is grpc.aio.EOF:
                    raise _Ended(grpc.StatusCode.UNAVAILABLE, "the controller ended the stream before its Welcome")
                if first.WhichOneof("body") != "welcome":
                    raise _Ended(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"the controller answered hello with {first.WhichOneof('body')}, not a Welcome")
                self._welcomed(first.welcome)
                conn = _Conn(call)
                self._conn = conn
                self.sink._connected(True)
                self.connections += 1
                tasks = [asyncio.get_running_loop().create_task(self._write(conn)),
                         asyncio.get_running_loop().create_task(self._beat(conn, first.welcome.heartbeat_s))]
                self._pump()
                try:
                    while True:
                        message = await self._io(call, call.read(), conn)
                        if message is grpc.aio.EOF:
                            code = await call.code()
                            if code != grpc.StatusCode.OK or not self._closing:
                                raise _Ended(code, await call.details() or "the controller ended the stream")
                            return
                        self._on_message(message)
                finally:
                    self._conn = None
                    self.sink._connected(False)
                    self._unanswered(conn)
                    for task in tasks:
                        task.cancel()
            finally:
                call.cancel()

    async def _io(self, call: Any, step: Any, conn: _Conn | None = None) -> Any:
        """Await a read or write; any ending of the call becomes `_Ended` with the call's status."""
        try:
            return await step
        except grpc.aio.AioRpcError as e:
            raise _Ended(e.code(), e.details() or "") from e
        except asyncio.InvalidStateError as e:
            raise _Ended(await call.code(), await call.details() or "the call ended") from e
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if (task is not None and task.cancelling()) or conn is None or not conn.broken:
                raise
            raise _Ended(grpc.StatusCode.UNAVAILABLE, "writing to the controller failed") from None

    def _welcomed(self, welcome: gyre_pb2.Welcome) -> None:
        if self.welcome is not None and welcome.run_id != self.welcome.run_id:
            raise _Ended(grpc.StatusCode.FAILED_PRECONDITION,
                         f"the controller now serves run {welcome.run_id!r}, not {self.welcome.run_id!r}")
        if self.welcome is None:
            self.welcome = welcome
            self._ready.set()

    def _on_message(self, message: Any) -> None:
        body = message.WhichOneof("body")
        if body == "ack":
            self.sink._ack(message.ack)
            conn = self._conn
            if conn is not None and message.ack.durable and not message.ack.error:
                while conn.window and conn.window[0] <= message.ack.batch_id:
                    conn.window.popleft()
                self._pump()  # what was recorded while `PACK_AHEAD` batches were out, as one
        elif body == "command":
            self._on_command(message.command)
        elif body == "weights" and message.weights.command_id:  # a newer plan for a ToRollout under way
            command_id = message.weights.command_id
            if command_id in self._seen and command_id not in self._done:
                self._plans[command_id] = message.weights
        elif body == "weights":
            asked = self._asked.pop(message.weights.ask_id, None)
            if asked is not None and not asked[1].done():
                asked[1].set_result(message.weights)
        else:
            log.warning("%s %r: ignoring an unexpected %s from the controller", self.kind, self.peer_id, body)

    async def _write(self, conn: _Conn) -> None:
        try:
            while True:
                message = await conn.queue.get()
                if message is _CLOSE:
                    await conn.call.done_writing()
                    return
                if isinstance(message, _Packed):
                    if self.error is not None:  # a batch could not be packed: none after it goes up either
                        continue
                    try:
                        data = await message.packed
                    except (GyreError, ValueError, pa.ArrowException) as e:  # a record that cannot be encoded
                        self._fail(ClusterError(f"{self.kind} {self.peer_id!r} could not pack records "
                                                f"{message.first}..{message.last}: {e}"))
                        continue
                    message = self._up(events=gyre_pb2.EventBatch(batch_id=message.last, arrow_ipc=data, wait=True))
                await conn.call.write(message)
                self.sent[message.WhichOneof("body")] += 1
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            conn.broken = True  # the reader learns the call's status
            log.debug("%s %r: write failed: %r", self.kind, self.peer_id, e)
            conn.call.cancel()

    async def _beat(self, conn: _Conn, every_s: float) -> None:
        """A heartbeat once nothing has gone up for ``every_s``: the hub takes any message as a sign of life,
        so a link that sent an event batch or a done within ``every_s`` does not beat (at 256 cells heartbeats
        were over half the messages the hub's loop moved)."""
        every_s = every_s if every_s > 0 else 1.0
        while True:
            wait = conn.last_up + every_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            elif self._silent:
                await asyncio.sleep(every_s)
            else:
                conn.put(self._up(heartbeat=gyre_pb2.Heartbeat(sent_us=time.time_ns() // 1000)))

    def _notify(self) -> None:
        """(Any thread.) A record waits: wake the loop to send it, once per burst — a wake-up per record (a
        pipe write) was a quarter of a recording thread's time at 256 cells."""
        if not self._pump_due:  # a pump already due takes this record too (it clears the flag, then reads)
            self._pump_due = True
            self._thread.call(self._pump_due_now)

    def _pump_due_now(self) -> None:
        self._pump_due = False
        self._pump()

    def _pump(self, *, before: bool = False) -> None:
        """Queue on the live call every record it has not been given yet, in order, coalesced into batches —
        unless `PACK_AHEAD` batches are out unacknowledged: then the records wait for an acknowledgement
        (`_on_message` pumps again). ``before``: queue them whatever is out, as a done must go up after every
        record made before it (its command's events are in the log before its caller learns it is done).

        A batch is packed on the link's packer thread, not on the loop (a step's burst of a thousand records
        took the loop ~0.1-0.5 s to pack, and no command, ack or done moved meanwhile); its place in the
        call's queue is taken now, so what is queued after it (a done) still goes up after it."""
        conn = self._conn
        if conn is None or (len(conn.window) >= PACK_AHEAD and not before):
            return
        loop = asyncio.get_running_loop()
        for group in self.sink._batches(conn.sent_upto):
            events = [e for record in group for e in record.events]
            try:
                packed = loop.run_in_executor(self._packer, pack_events, events)
            except RuntimeError:  # the packer was shut down: the link is stopping
                return
            conn.put(_Packed(group[0].record_id, group[-1].record_id, packed))
            conn.sent_upto = group[-1].record_id
            conn.window.append(conn.sent_upto)

    def _up(self, **body: Any) -> gyre_pb2.CellUp | gyre_pb2.ProxyUp:
        return gyre_pb2.CellUp(**body) if self.kind == "cell" else gyre_pb2.ProxyUp(**body)

    def _fail(self, error: ClusterError) -> None:
        if self.error is not None:
            return
        self.error = error
        log.error("%s", error)
        self.sink._fail(SinkError(str(error)))
        self._ready.set()
        if self.on_failed is not None:
            try:
                self.on_failed(error)
            except Exception:  # the process's bug: logged with its traceback
                log.exception("ControllerLink.on_failed raised")

    # -- asks ----------------------------------------------------------------------------------------------

    def ask_weights(self, timeout_s: float = ASK_TIMEOUT_S) -> gyre_pb2.WeightsAnswer:
        """(A cell's command thread.) Which weights the controller says this cell's engine should load now
        (`WeightsAsk`, answered from the log). `Unavailable` (transient: the command is sent again) when no
        stream is up, it breaks before the answer, or none comes within ``timeout_s``."""
        if self.kind != "cell":
            raise TypeError("only a cell asks for weights")
        future = self._thread.submit(self._ask())
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise Unavailable(f"cell {self.peer_id!r}: the controller did not answer a weights ask within "
                              f"{timeout_s} s") from None

    async def _ask(self) -> gyre_pb2.WeightsAnswer:
        conn = self._conn
        if conn is None:
            raise Unavailable(f"cell {self.peer_id!r} is not connected to the controller: it cannot ask for weights")
        self._asks += 1
        ask_id = self._asks
        answer: asyncio.Future[gyre_pb2.WeightsAnswer] = asyncio.get_running_loop().create_future()
        self._asked[ask_id] = (conn, answer)
        conn.put(self._up(ask=gyre_pb2.WeightsAsk(ask_id=ask_id)))
        try:
            return await answer
        finally:
            self._asked.pop(ask_id, None)

    def planned(self, command_id: int, plan: gyre_pb2.WeightsAnswer) -> gyre_pb2.WeightsAnswer:
        """(A cell's command thread.) The weights to load for the ToRollout ``command_id`` now: the last answer the
        controller sent down for it, else its ``plan`` (`ToRollout.plan`; the stream is read in order, so an
        answer sent before this moment's has arrived unless it is still in flight, as an ask's would be)."""
        return self._plans.get(command_id, plan)

    def _unanswered(self, conn: _Conn) -> None:
        """The stream ``conn`` ended: its asks will not be answered (the command asking fails, transiently)."""
        for ask_id, (asked_on, answer) in list(self._asked.items()):
            if asked_on is conn:
                del self._asked[ask_id]
                if not answer.done():
                    answer.set_exception(Unavailable(f"cell {self.peer_id!r}: the stream to the controller ended "
                                                     "before it answered a weights ask"))

    # -- commands ------------------------------------------------------------------------------------------

    def _on_command(self, command: Command) -> None:
        command_id = command.command_id
        if command_id in self._done:
            if self._conn is not None:
                self._pump(before=True)
                self._conn.put(self._up(done=self._done[command_id]))
        elif command_id not in self._seen:
            self._seen.add(command_id)
            self._commands.put(command)

    def _command_loop(self) -> None:
        while True:
            command = self._commands.get()
            if command is None:
                return
            done, durable = self._execute(command)
            if durable is None:
                self._thread.call(self._finished, done)
            else:
                with self._deferred_cond:
                    self._deferred += 1
                self._thread.call(self._finish_when_durable, done, durable.sink or self.sink, durable.position,
                                  durable.remote)

    def wait_deferred(self, timeout_s: float | None = None) -> bool:
        """Block until every done that waits for its events to be durable (`Durable`) has been sent up, so a
        done sent after this goes up after them (a Sync's promise: every earlier command is done). False if
        some still wait after ``timeout_s``."""
        with self._deferred_cond:
            return self._deferred_cond.wait_for(lambda: self._deferred == 0, timeout_s)

    def _finish_when_durable(self, done: gyre_pb2.CommandDone, sink: RemoteSink, position: int,
                             remote: bool) -> None:
        async def finish() -> None:
            try:
                try:
                    await sink.durable(position, remote=remote)
                except SinkError as e:  # the link failed: its done could not go up anyway
                    done.CopyFrom(failed_done(done.command_id, e))
                self._finished(done)
            finally:  # (a cancelled wait too: the link is closing)
                with self._deferred_cond:
                    self._deferred -= 1
                    self._deferred_cond.notify_all()
        task = asyncio.get_running_loop().create_task(finish())
        self._waiting.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._waiting.discard)

    def _execute(self, command: Command) -> tuple[gyre_pb2.CommandDone, Durable | None]:
        """The command's done, and what it waits for to be durable (None: it goes up at once)."""
        body = command.WhichOneof("body")
        durable = None
        try:
            if self.handler is None:
                raise ClusterError(f"{self.kind} {self.peer_id!r} takes no command on its {self.lane!r} lane")
            result = self.handler(command)
            if isinstance(result, Durable):
                durable, result = result, result.answer
            done = gyre_pb2.CommandDone(ok=True)
            if isinstance(result, gyre_pb2.CommandDone):  # a command with a result (Train: its WeightsRef)
                done.CopyFrom(result)
                done.ok = not done.error  # proto3's ok defaults to False: only an error makes it a failure
            else:
                for name, value in (result or {}).items():
                    done.figures[name] = float(value)
            done.command_id = command.command_id
        except Exception as e:  # reported to the controller as ok=False, with the error and its class
            log.exception("%s %r: command %d (%s) failed", self.kind, self.peer_id, command.command_id, body)
            return failed_done(command.command_id, e), None
        return done, durable

    DONE_KEPT = 4096
    """Outcomes kept to answer a repeated command: the hub repeats only those pending when a stream broke."""

    def _finished(self, done: gyre_pb2.CommandDone) -> None:
        self._done[done.command_id] = done
        self._plans.pop(done.command_id, None)
        while len(self._done) > self.DONE_KEPT:
            del self._done[next(iter(self._done))]
        if self._conn is not None:
            self._pump(before=True)  # the records made before it go up before it
            self._conn.put(self._up(done=done))


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None], error: BaseException | None) -> None:
    def settle() -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # that loop is closed: nobody awaits there any more
        return
