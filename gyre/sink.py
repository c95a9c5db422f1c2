"""The one way events reach a log: an `EventSink`, fed by producers that stamp what they send.

Every component that produces events — the proxy, the harness runner, the trainer's step coordinator, the
simulator, the controller itself — takes an `EventSink` and calls `record`; none of them holds a
`LogWriter`. The contract is the one a remote transport will keep (the next step moves cells into
processes and carries these calls over gRPC):

- `record(events) -> position`: the events are ordered after everything recorded before them; the
  position is the log seq of the last one (or, for a batch the writer already held, a position at or after
  it).
- `commit(position)` blocks, `await durable(position)` suspends, until that position is durable.

Exactly once: a `Producer` stamps every event with its id and its own gapless sequence number. The writer
path (`LogSink`) keeps the last number it holds per producer — rebuilt from the log when a run resumes —
and drops events it already holds, so a batch re-sent after a reconnect or a resume is never doubled; a
gap (a batch lost in between) is refused, never papered over.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, Protocol, TypeVar, runtime_checkable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gyre.errors import GyreError, LogError
from gyre.events.codec import now_us, stamped_ts
from gyre.events.models import Event
from gyre.log.writer import LogWriter

log = logging.getLogger(__name__)

E = TypeVar("E", bound=Event)

Recorded = Callable[[int, "list[Event] | pa.RecordBatch"], None]
"""Told, in seq order and under the sink's lock, the first seq and what was just appended: events, or a
producer's Arrow batch (`LogSink.record_batch`) as the log holds it (``ts`` filled; ``seq`` absent and a
null ``run_id`` left to the writer, as in the events)."""


LoopCommit = Literal["inline", "split", "thread"]
"""How `LogSink.durable` commits for the coroutines of a loop (those that ask in one iteration of the loop
share one commit, made in its next): ``split`` writes on the loop and leaves only the fdatasync to the
committer thread, which wakes the loop once; ``inline`` commits a lone call's event on the loop itself, write
and fdatasync, when the committer is idle (no thread hand-off at all), and splits a burst (the fsync then
overlaps the loop's work on the next calls); ``thread`` hands every commit to the committer and back (the
path before #33, kept for the A/B of `benchmarks.proxy_bench`)."""


class SinkError(GyreError):
    """A producer's batch cannot be taken: a gap in its sequence numbers, or the sink is closed."""


@runtime_checkable
class EventSink(Protocol):
    """Ordered, durable recording of events; safe to call from several threads."""

    def record(self, events: Event | Sequence[Event]) -> int:
        """Order ``events`` after everything recorded before; returns the position of the last one."""
        ...

    def commit(self, position: int | None = None) -> None:
        """Block until ``position`` (default: everything recorded so far) is durable."""
        ...

    async def durable(self, position: int) -> None:
        """Return once the event at ``position``, and all before it, is durable; raise if it cannot be."""
        ...

    def close(self) -> None: ...


def _as_list(events: Event | Sequence[Event]) -> list[Event]:
    return [events] if isinstance(events, Event) else list(events)


class MemorySink:
    """Keeps events in a list (tests, embedding without a log); everything is durable at once."""

    def __init__(self) -> None:
        self._events: list[Event] = []
        self._lock = threading.Lock()

    def record(self, events: Event | Sequence[Event]) -> int:
        with self._lock:
            self._events.extend(_as_list(events))
            return len(self._events) - 1

    def commit(self, position: int | None = None) -> None:
        return None

    async def durable(self, position: int) -> None:
        return None

    def close(self) -> None:
        return None

    @property
    def events(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    def of(self, kind: type[E], execution_id: str | None = None) -> list[E]:
        """The recorded events of one type (and execution), in order."""
        return [e for e in self.events
                if isinstance(e, kind) and (execution_id is None or e.execution_id == execution_id)]


class NullSink(MemorySink):
    """Drops everything (benchmarks of a producer alone)."""

    def record(self, events: Event | Sequence[Event]) -> int:
        return -1


class LogSink:
    """The writer path: dedups producers' events, appends them, group-commits on a committer thread.

    Appends happen in the caller's thread (the writer only buffers); one committer thread commits
    everything pending at once and wakes the waiters (one fsync covers many calls finishing together).
    Events nobody waits for ride along with the next commit, or are committed within ``flush_interval_s``
    (``None``: only when asked, for a simulator that commits once at the end): the committer looks every half
    interval and commits what was appended before its previous look, so a steady stream nobody waits for is
    committed once an interval, and an event that a waited-for commit takes along within ms costs no fsync.

    Events without a ``ts`` are stamped here, under the lock, when ``on_record`` is set, so that what it sees
    is exactly what the log holds (a live fold and a replay of the log see the same events); without it the
    writer stamps them as it takes them (the proxy's path: no copy of each event).
    """

    COMMIT_EVENTS = 16_384
    """With ``flush_interval_s=None`` (nobody waits), a commit is still asked for, without waiting, every this
    many events: a simulated run reaches the disk in bounded frames as it goes, not in one frame at close."""

    def __init__(self, writer: LogWriter, *, close_writer: bool = True, flush_interval_s: float | None = 0.2,
                 on_record: Recorded | None = None, loop_commit: LoopCommit = "inline") -> None:
        self.writer = writer
        self.loop_commit = loop_commit
        self.flush_interval_s = flush_interval_s
        self.on_record = on_record
        self._close_writer = close_writer
        self._lock = threading.Lock()
        self._held = producer_positions(writer)
        self._cond = threading.Condition()
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop | None, asyncio.Future[None] | threading.Event]] = []
        self._pending = False
        self._closed = False
        self._unasked = 0
        self._error: BaseException | None = None
        self._groups: dict[asyncio.AbstractEventLoop, list[tuple[int, asyncio.Future[None]]]] = {}
        """Per loop, the coroutines that asked `durable` since that loop's last commit (one commit for all)."""
        self._committing = False
        """The committer thread is inside a commit (an inline one would wait behind it, stalling its loop)."""
        self._busy: list[Callable[[], bool]] = []
        self._thread = threading.Thread(target=self._run, name="gyre-log-committer", daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, path: str | Path, run_id: str, **options) -> LogSink:
        """A sink over a new log directory; refuses one that already holds a log."""
        path = Path(path)
        if path.exists() and any(path.glob("*.seg")):
            from gyre.errors import ConfigError

            raise ConfigError(f"log directory {path} already holds a log; give an empty or new directory")
        return cls(LogWriter(path, run_id=run_id), **options)

    # -- producers -----------------------------------------------------------------------------------------

    def producer(self, producer_id: str) -> Producer:
        """A stamping handle for ``producer_id``, continuing after the last event the log holds from it."""
        with self._lock:
            return Producer(self, producer_id, self._held.get(producer_id, -1) + 1)

    def held(self, producer_id: str) -> int:
        """The last sequence number the log holds from a producer (-1: none)."""
        with self._lock:
            return self._held.get(producer_id, -1)

    # -- recording -----------------------------------------------------------------------------------------

    def record(self, events: Event | Sequence[Event]) -> int:
        batch = _as_list(events)
        with self._lock:
            if self._closed:
                raise SinkError("the log sink is closed")
            fresh = self._fresh(batch)
            if not fresh:
                return self.writer.next_seq - 1
            if self.on_record is not None:  # told: stamped here, so it sees the ts the log stores
                now = datetime.now(UTC)
                fresh = [e if e.ts is not None else e.model_copy(update={"ts": now}) for e in fresh]
            # else the writer stamps them at the same moment (`LogWriter.append`), without a copy of each
            appended = self.writer.append(fresh[0] if len(fresh) == 1 else fresh)
            for event in fresh:
                if event.producer is not None:
                    self._held[event.producer] = event.producer_seq
            if self.on_record is not None:
                self.on_record(appended.first, fresh)
            if self.flush_interval_s is None:
                self._unasked += len(fresh)
                if self._unasked >= self.COMMIT_EVENTS:
                    self.writer.commit(wait=False)
                    self._unasked = 0
            return appended.last

    def _fresh(self, batch: list[Event]) -> list[Event]:
        """Drop events the log already holds; refuse a gap in a producer's sequence."""
        if all(e.producer is None for e in batch):
            return batch
        expected: dict[str, int] = {}
        out = []
        for event in batch:
            if event.producer is None:
                out.append(event)
                continue
            if event.producer_seq is None:
                raise SinkError(f"producer {event.producer!r} sent a {event.kind} without producer_seq")
            last = expected.get(event.producer, self._held.get(event.producer, -1))
            if event.producer_seq <= self._held.get(event.producer, -1):
                continue  # held already: a re-sent event
            if event.producer_seq != last + 1:
                raise SinkError(f"producer {event.producer!r} skipped from {last} to {event.producer_seq}: "
                                f"events {last + 1}..{event.producer_seq - 1} never arrived")
            expected[event.producer] = event.producer_seq
            out.append(event)
        return out

    def record_batch(self, batch: pa.RecordBatch) -> int:
        """`record` for a remote producer's Arrow batch as it arrived (no ``seq``): deduplicated, checked and
        appended without a row ever becoming an event object (decoding and re-encoding a model call cost
        the controller ~0.35 ms of its one interpreter lock). Every row must carry a producer stamp."""
        with self._lock:
            if self._closed:
                raise SinkError("the log sink is closed")
            fresh, last = self._fresh_rows(batch)
            if not fresh.num_rows:
                return self.writer.next_seq - 1
            index = fresh.schema.get_field_index("ts")
            ts = stamped_ts(None if index < 0 else fresh.column(index), fresh.num_rows, now_us())
            fresh = fresh.append_column("ts", ts) if index < 0 else fresh.set_column(index, "ts", ts)
            appended = self.writer.append_batch(fresh)
            self._held.update(last)
            if self.on_record is not None:
                self.on_record(appended.first, fresh)
            if self.flush_interval_s is None:
                self._unasked += fresh.num_rows
                if self._unasked >= self.COMMIT_EVENTS:
                    self.writer.commit(wait=False)
                    self._unasked = 0
            return appended.last

    def _fresh_rows(self, batch: pa.RecordBatch) -> tuple[pa.RecordBatch, dict[str, int]]:
        """`_fresh` on columns: the rows the log does not hold yet, and each producer's last number in them."""
        producers, numbers = batch.column("producer"), batch.column("producer_seq")
        if producers.null_count or numbers.null_count:
            raise SinkError("a batch recorded as Arrow needs a producer stamp (producer, producer_seq) on every row")
        seqs = numbers.to_numpy(zero_copy_only=False)
        names = pc.unique(producers).to_pylist()
        keep = np.zeros(len(seqs), dtype=bool) if len(names) > 1 else None
        last: dict[str, int] = {}
        for name in names:
            mine = None if keep is None else pc.equal(producers, name).to_numpy(zero_copy_only=False)
            own = seqs if mine is None else seqs[mine]
            held = self._held.get(name, -1)
            new = own[own > held]
            expected = np.arange(held + 1, held + 1 + len(new), dtype=new.dtype)
            if not np.array_equal(new, expected):
                at = int(np.flatnonzero(new != expected)[0])
                before, got = int(expected[at]) - 1, int(new[at])
                raise SinkError(f"producer {name!r} skipped from {before} to {got}: events "
                                f"{before + 1}..{got - 1} never arrived")
            if len(new):
                last[name] = int(new[-1])
            if keep is not None:
                keep[mine] = own > held
            elif len(new) < len(own):
                keep = seqs > held
        return (batch if keep is None or keep.all() else batch.filter(pa.array(keep))), last

    def commit(self, position: int | None = None) -> None:
        target = self.writer.next_seq - 1 if position is None else position
        if self.writer.durable_seq >= target:
            return
        done = threading.Event()
        self._wait(target, None, done)
        done.wait()
        if self._error is not None:
            raise LogError(f"the log committer failed: {self._error!r}") from self._error

    async def durable(self, position: int) -> None:
        if self.writer.durable_seq >= position:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        if self.loop_commit == "thread":
            self._wait(position, loop, future)
        else:
            self._join_group(loop, position, future)
        await future

    def busy_when(self, busy: Callable[[], bool]) -> None:
        """Tell the sink when its users have other work in flight on their loop (the proxy: other calls), so
        a lone call's commit is not made inline, stalling that work for an fdatasync (see `LoopCommit`)."""
        self._busy.append(busy)

    def _join_group(self, loop: asyncio.AbstractEventLoop, position: int, future: asyncio.Future[None]) -> None:
        """Wait in this loop's group; the first to join schedules the group's commit for the loop's next
        iteration, so every call that finishes in this one shares its fsync."""
        with self._cond:
            if self._error is not None:
                raise LogError(f"the log committer failed: {self._error!r}") from self._error
            group = self._groups.get(loop)
            first = group is None
            if group is None:
                group = self._groups[loop] = []
            group.append((position, future))
        if first:
            loop.call_soon(self._commit_group, loop)

    def _commit_group(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``, its group's commit (see `LoopCommit`). Inline only for a lone call with the
        committer idle and nothing else in flight (`busy_when`): the loop stalls for the fdatasync, which
        costs nothing while no other work waits for it."""
        with self._cond:
            group = self._groups.pop(loop)
            error = self._error
            alone = len(group) == 1 and not self._committing and not self._waiters
        alone = alone and not any(busy() for busy in self._busy)
        target = max(position for position, _ in group)
        if error is None and self.writer.durable_seq < target:
            try:
                if self.loop_commit == "inline" and alone:
                    self.writer.commit(target)
                else:
                    self.writer.write(target)
                    with self._cond:
                        self._waiters.extend((position, loop, future) for position, future in group)
                        self._pending = True
                        self._cond.notify()
                    return
            except LogError as e:  # the writer is closed or failed: these waiters, and every later one, learn it
                log.error("log commit failed: %r", e)
                self._fail(e)
                error = e
        failure = None if error is None else LogError(f"the log committer failed: {error!r}")
        for _, future in group:
            _resolve(future, failure)

    def _wait(self, position: int, loop: asyncio.AbstractEventLoop | None,
              waiter: asyncio.Future[None] | threading.Event) -> None:
        with self._cond:
            if self._error is not None:
                raise LogError(f"the log committer failed: {self._error!r}") from self._error
            self._waiters.append((position, loop, waiter))
            self._pending = True
            self._cond.notify()

    def _run(self) -> None:
        tick = None if self.flush_interval_s is None else self.flush_interval_s / 2
        mark = -1  # the writer's last seq at the previous tick
        while True:
            with self._cond:
                if not self._pending and not self._closed:
                    self._cond.wait(tick)
                if self._closed and not self._waiters and self.writer.durable_seq >= self.writer.next_seq - 1:
                    return
                if not self._pending and not self._closed:
                    if tick is None:
                        continue
                    # A tick (every half interval) commits only what was appended before the previous tick and
                    # is still not durable: so within one interval, yet an event whose own commit is on its way
                    # (the proxy's `model_call_started`, durable with its call's end ~ms later) rides along with
                    # it, instead of costing an fdatasync of its own five times a second that collides with the
                    # loop's commits (the committer then busy, the loop's commit went to the thread and back).
                    before, mark = mark, self.writer.next_seq - 1
                    if self.writer.durable_seq >= before:
                        continue
                self._pending = False
            if self.writer.durable_seq >= self.writer.next_seq - 1:
                self._wake(self.writer.durable_seq)
                continue
            self._committing = True
            try:
                durable = self.writer.commit()
            except LogError as e:  # the writer is closed or failed: every waiter must learn it
                log.error("log commit failed: %r", e)
                self._fail(e)
                return
            finally:
                self._committing = False
            self._wake(durable)

    def _wake(self, durable: int) -> None:
        with self._cond:
            ready = [w for w in self._waiters if w[0] <= durable]
            self._waiters = [w for w in self._waiters if w[0] > durable]
        _resolve_all(ready, None)

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            waiters, self._waiters = self._waiters, []
        _resolve_all(waiters, LogError(f"the log committer failed: {error!r}"))

    def close(self) -> None:
        """Commit what is pending, stop the committer, and close the writer if this sink owns it. Idempotent."""
        with self._lock:
            if self._closed and not self._thread.is_alive():
                return
            self._closed = True
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join()
        if self._close_writer:
            self.writer.close()

    def __enter__(self) -> LogSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Producer:
    """A producer's handle on a sink: stamps its id and next sequence number on each event it records.

    It is itself an `EventSink`, so a component never knows whether its events are stamped; the stamps
    are what let the writer drop a re-sent batch.
    """

    def __init__(self, sink: EventSink, producer_id: str, next_seq: int = 0) -> None:
        self.sink = sink
        self.producer_id = producer_id
        self._next = next_seq
        self._lock = threading.Lock()

    def record(self, events: Event | Sequence[Event]) -> int:
        batch = _as_list(events)
        with self._lock:  # numbering and handing on together, so the sink sees this producer in order
            stamped = [e.model_copy(update={"producer": self.producer_id, "producer_seq": self._next + i})
                       for i, e in enumerate(batch)]
            position = self.sink.record(stamped)
            self._next += len(batch)
            return position

    @property
    def next_seq(self) -> int:
        return self._next

    def commit(self, position: int | None = None) -> None:
        self.sink.commit(position)

    async def durable(self, position: int) -> None:
        await self.sink.durable(position)

    def close(self) -> None:
        return None  # the sink belongs to whoever made it


def producer_positions(writer: LogWriter) -> dict[str, int]:
    """The last sequence number the log holds from each producer (empty for a new log)."""
    if writer.next_seq == 0:
        return {}
    writer.commit()
    from gyre.log import LogReader

    con = LogReader(writer.path).duckdb()
    rows = con.execute("SELECT producer, max(producer_seq) FROM events WHERE producer IS NOT NULL "
                       "GROUP BY producer").fetchall()
    return {producer: int(last) for producer, last in rows}


def _resolve_all(waiters: list[tuple[int, asyncio.AbstractEventLoop | None, asyncio.Future[None] | threading.Event]],
                 error: BaseException | None) -> None:
    """Wake waiters from the committer thread: threads directly, each loop once for all its futures (a
    wake-up of a loop from another thread costs a write to its self-pipe and a pass of its poll)."""
    futures: dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]] = {}
    for _, loop, waiter in waiters:
        if isinstance(waiter, threading.Event):
            waiter.set()
        else:
            assert loop is not None
            futures.setdefault(loop, []).append(waiter)
    for loop, mine in futures.items():
        try:
            loop.call_soon_threadsafe(_resolve_each, mine, error)
        except RuntimeError:  # that loop is closed: its server stopped and nobody waits any more
            continue


def _resolve_each(futures: list[asyncio.Future[None]], error: BaseException | None) -> None:
    for future in futures:
        _resolve(future, error)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
