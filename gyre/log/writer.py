"""The single writer of a log: append, group commit, rotation, crash recovery.

Durability contract: ``append`` assigns seqs and buffers in memory; ``commit`` writes every buffered
event as framed batches and fdatasyncs before it returns. An acknowledged (committed) event is never
lost; a crash loses only what was appended after the last acknowledged commit, and the next writer
continues the gapless seq from the last durable event.

Group commit: any number of threads may ``append`` and ``commit``. One committer at a time becomes the
leader, takes *everything* buffered so far (its own events and everybody else's), writes it with one
``writev`` and one fsync, and wakes the others, whose events are now durable too.
"""

import fcntl
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gyre.errors import LogClosedError, LogError, LogLockedError
from gyre.events.codec import check_events, encode, now_us, validate_batch
from gyre.events.models import Event
from gyre.events.schema import TS_TYPE, event_schema
from gyre.log.segment import (
    SegmentData,
    batch_frame_parts,
    fsync_dir,
    list_segments,
    schema_frame,
    segment_name,
)

log = logging.getLogger(__name__)

LOCK_FILE = "LOCK"
DEFAULT_SEGMENT_BYTES = 64 << 20


class SeqRange(NamedTuple):
    """Inclusive range of seqs given to one append (``last < first`` for an empty append)."""

    first: int
    last: int


class LogRecoveryWarning(UserWarning):
    """Opening a log cut back a torn tail left by a crash."""


@dataclass(frozen=True)
class Recovery:
    segment: str | None
    dropped_bytes: int
    next_seq: int


@dataclass
class WriterStats:
    fsyncs: int = 0
    bytes: int = 0


@dataclass
class _EventRun:
    """Consecutive events appended one at a time: encoded as one batch when committed."""

    first_seq: int
    events: list[Event]
    stamps: list[int]


class _ReadyFrame:
    """A batch already framed (by ``append_batch``): the commit leader only writes it."""

    __slots__ = ("first_seq", "parts", "size")

    def __init__(self, first_seq: int, parts: list) -> None:
        self.first_seq = first_seq
        self.parts = parts
        self.size = sum(len(memoryview(p)) for p in parts)


@lru_cache(maxsize=256)
def _stored_schema(names: tuple[str, ...]) -> pa.Schema:
    """The schema of a validated producer batch (columns ``names``) with the ``seq`` and ``ts`` it gets."""
    full = event_schema()
    return pa.schema([full.field(n) for n in ("seq", "ts", *names)], metadata=full.metadata)


def _with_run_id(batch: pa.RecordBatch, run_id: str, schema: pa.Schema) -> pa.RecordBatch:
    """Stamp the writer's run id where the producer left it empty (as ``encode`` does for events)."""
    columns = dict(zip(batch.schema.names, batch.columns, strict=True))
    current = columns.get("run_id")
    if current is not None and current.null_count == 0:
        return batch
    stamp = pa.scalar(run_id, pa.string())
    columns["run_id"] = pa.repeat(stamp, batch.num_rows) if current is None else pc.fill_null(current, stamp)
    fields = [f for f in schema if f.name in columns]
    return pa.RecordBatch.from_arrays([columns[f.name] for f in fields], schema=pa.schema(fields))


class LogWriter:
    """Exclusive, durable appender of a log directory. Use as a context manager or call ``close``."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        run_id: str | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        group_commit_window_s: float = 0.0,
        seal: bool = True,
        max_pending_events: int = 1_000_000,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.segment_bytes = segment_bytes
        self.group_commit_window_s = group_commit_window_s
        self.max_pending_events = max_pending_events
        self._schema = event_schema()
        self._lock_fd = self._acquire_lock()
        self._cond = threading.Condition(threading.Lock())
        self._pending_events: list[Event] = []
        self._pending_stamps: list[int] = []
        self._pending_first = 0
        self._chunks: list[_ReadyFrame | _EventRun] = []
        self.stats = WriterStats()
        self._flushing = False
        self._failed: BaseException | None = None
        self._closed = False
        self._fd = -1
        self._sealer = _Sealer(self.path) if seal else None
        try:
            self.recovery = self._recover()
        except BaseException:
            self._release_lock()
            raise
        self._next_seq = self.recovery.next_seq
        self._durable_seq = self._next_seq - 1
        self._pending_first = self._next_seq

    # -- opening -----------------------------------------------------------------------------------------

    def _acquire_lock(self) -> int:
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LogLockedError(
                f"log {self.path} is already open for writing (holder pid {holder}); a log has one writer"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _recover(self) -> Recovery:
        segments = list_segments(self.path)
        while segments:
            first_seq, path = segments[-1]
            data = SegmentData(path)
            found = data.scan(tail_ok=True)
            if found.schema is None:
                # Crashed while creating this segment: it holds no event, drop it.
                warnings.warn(f"removing {path.name}: its schema frame was never completed",
                              LogRecoveryWarning, stacklevel=3)
                path.unlink()
                fsync_dir(self.path)
                segments.pop()
                continue
            dropped = 0
            if found.torn_bytes:
                dropped = found.torn_bytes
                with open(path, "r+b") as f:
                    f.truncate(found.valid_end)
                    os.fsync(f.fileno())
                message = (f"log {self.path}: cut a torn tail of {dropped} bytes from {path.name} at byte "
                           f"offset {found.valid_end} (a crash mid-write; no acknowledged event was in it)")
                warnings.warn(message, LogRecoveryWarning, stacklevel=3)
                log.warning(message)
            batches = found.frames[1:]
            next_seq = batches[-1].first_seq + batches[-1].count if batches else first_seq
            if self._sealer is not None:
                for _, older in segments[:-1]:
                    self._sealer.submit(older)
            same_schema = found.schema.equals(self._schema, check_metadata=True)
            if same_schema:
                self._fd = os.open(path, os.O_WRONLY)
                self._offset = found.valid_end
                self._segment, self._segment_first = path, first_seq
            elif not batches:  # an empty segment of an older schema: replace it
                path.unlink()
                self._open_segment(next_seq)
            else:  # older schema: leave it sealed, continue in a new segment
                if self._sealer is not None:
                    self._sealer.submit(path)
                self._open_segment(next_seq)
            return Recovery(path.name, dropped, next_seq)
        self._open_segment(0)
        return Recovery(None, 0, 0)

    def _open_segment(self, first_seq: int) -> None:
        path = self.path / segment_name(first_seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        header = schema_frame(self._schema, first_seq)
        _write_all(fd, [header], 0)
        os.fsync(fd)
        fsync_dir(self.path)
        self._fd, self._offset, self._segment, self._segment_first = fd, len(header), path, first_seq

    # -- appending ---------------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def durable_seq(self) -> int:
        """Highest committed seq (-1 for an empty log)."""
        return self._durable_seq

    def append(self, events: Event | Iterable[Event]) -> SeqRange:
        """Buffer validated events and give them the next seqs; ``commit`` makes them durable."""
        stamp = time.time_ns() // 1000
        if isinstance(events, Event) and type(events) is not Event:  # one event: the hot path, no lists
            with self._cond:
                if self._closed or self._failed is not None:
                    self._check_usable()
                first = self._next_seq
                self._pending_events.append(events)
                self._pending_stamps.append(stamp)
                self._next_seq = first + 1
                overflow = len(self._pending_events) >= self.max_pending_events
            if overflow:
                self.commit()
            return SeqRange(first, first)
        batch = check_events([events] if isinstance(events, Event) else events)
        with self._cond:
            self._check_usable()
            first = self._next_seq
            self._pending_events.extend(batch)
            self._pending_stamps.extend([stamp] * len(batch))
            self._next_seq += len(batch)
            overflow = len(self._pending_events) >= self.max_pending_events
        if overflow:
            self.commit()
        return SeqRange(first, first + len(batch) - 1)

    def append_batch(self, batch: pa.RecordBatch | pa.Table) -> SeqRange:
        """Columnar fast path: append a producer-built batch (envelope ids, ``kind``, payload structs).

        It is validated before it gets seqs (a bad batch raises and nothing is buffered), and framed right
        here, in the producer's thread, so that the commit leader only writes and fsyncs: with several
        producers, framing overlaps the previous group's fsync.
        """
        checked = validate_batch(batch)
        n = checked.num_rows
        if self.run_id is not None:
            checked = _with_run_id(checked, self.run_id, self._schema)
        stamp = now_us()
        with self._cond:
            self._check_usable()
            first = self._next_seq
            self._cut_event_chunk()
            seq = pa.array(np.arange(first, first + n, dtype=np.int64))
            ts = pa.array(np.full(n, stamp, dtype="datetime64[us]"), TS_TYPE)
            full = pa.RecordBatch.from_arrays([seq, ts, *checked.columns],
                                              schema=_stored_schema(tuple(checked.schema.names)))
            self._chunks.append(_ReadyFrame(first, batch_frame_parts(full, first, self._schema)))
            self._next_seq += n
            self._pending_first = self._next_seq
        return SeqRange(first, first + n - 1)

    def _cut_event_chunk(self) -> None:
        if self._pending_events:
            self._chunks.append(_EventRun(self._pending_first, self._pending_events, self._pending_stamps))
            self._pending_events, self._pending_stamps = [], []
        self._pending_first = self._next_seq

    # -- committing --------------------------------------------------------------------------------------

    def commit(self, upto: int | None = None) -> int:
        """Make every event appended so far (or up to seq ``upto``) durable; return the durable seq."""
        while True:
            with self._cond:
                target = self._next_seq - 1 if upto is None else upto
                while True:
                    self._check_failed()
                    if self._durable_seq >= target:
                        return self._durable_seq
                    if not self._flushing:
                        self._flushing = True
                        break
                    self._cond.wait()
            self._lead_commit()

    def _lead_commit(self) -> None:
        try:
            if self.group_commit_window_s > 0:
                time.sleep(self.group_commit_window_s)
            with self._cond:
                self._cut_event_chunk()
                chunks, self._chunks = self._chunks, []
                last = self._next_seq - 1
            self._write(chunks)
        except BaseException as error:
            with self._cond:
                self._failed = error
                self._flushing = False
                self._cond.notify_all()
            raise
        with self._cond:
            self._durable_seq = last
            self._flushing = False
            self._cond.notify_all()

    def _write(self, chunks: list) -> None:
        """Write frames in seq order, rotating between frames when the segment is full; fsync at the end."""
        parts: list = []
        size = 0
        for chunk in chunks:
            if isinstance(chunk, _EventRun):
                batch = encode(chunk.events, chunk.first_seq, chunk.stamps, run_id=self.run_id)
                chunk = _ReadyFrame(chunk.first_seq, batch_frame_parts(batch, chunk.first_seq, self._schema))
            if self._offset + size >= self.segment_bytes and chunk.first_seq > self._segment_first:
                self._sync(parts, size)
                self._rotate(chunk.first_seq)
                parts, size = [], 0
            parts.extend(chunk.parts)
            size += chunk.size
        if parts:
            self._sync(parts, size)

    def _sync(self, parts: list, size: int) -> None:
        _write_all(self._fd, parts, self._offset)
        os.fdatasync(self._fd)
        self._offset += size
        self.stats.fsyncs += 1
        self.stats.bytes += size

    def _rotate(self, first_seq: int) -> None:
        old, old_fd = self._segment, self._fd
        self._open_segment(first_seq)
        os.close(old_fd)
        if self._sealer is not None:
            self._sealer.submit(old)

    def _check_usable(self) -> None:
        if self._closed:
            raise LogClosedError(f"log writer for {self.path} is closed")
        self._check_failed()

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise LogClosedError(
                f"log writer for {self.path} failed and accepts nothing more: {self._failed!r}"
            ) from self._failed

    # -- closing -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Commit what was appended, then release the log. Idempotent."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self.commit()
        finally:
            self._closed = True
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            if self._sealer is not None:
                self._sealer.close()
            self._release_lock()

    def __enter__(self) -> "LogWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_all(fd: int, parts: list, offset: int) -> None:
    """``pwritev`` at ``offset`` that finishes partial writes (the kernel may write fewer bytes than asked)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        written = os.pwritev(fd, views[:1024], offset)
        offset += written
        while written:
            if written >= len(views[0]):
                written -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][written:]
                written = 0


class _Sealer:
    """Background thread that rewrites rotated segments as Parquet for fast, pushed-down DuckDB scans.

    The framed segment stays the truth; the Parquet file is a derived, atomically renamed copy.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="gyre-log-sealer", daemon=True)
        self._thread.start()

    def submit(self, segment: Path) -> None:
        self._queue.put(segment)

    def _run(self) -> None:
        from gyre.log.seal import seal_segment, usable_sealed_copy

        while (segment := self._queue.get()) is not None:
            try:
                if usable_sealed_copy(segment) is None:
                    seal_segment(segment)
            except (LogError, OSError, pa.ArrowException) as error:
                log.error("could not seal %s (queries fall back to its frames): %s", segment, error)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
