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
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa

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
        self._cond = threading.Condition()
        self._pending_events: list[Event] = []
        self._pending_stamps: list[int] = []
        self._pending_first = 0
        self._chunks: list[pa.RecordBatch | tuple[list[Event], list[int], int]] = []
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
                self._segment = path
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
        _write_all(fd, [header])
        os.fsync(fd)
        fsync_dir(self.path)
        self._fd, self._offset, self._segment = fd, len(header), path

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
        batch = check_events([events] if isinstance(events, Event) else events)
        stamp = now_us()
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

        It is validated before it gets seqs; a bad batch raises and nothing is buffered.
        """
        checked = validate_batch(batch)
        n = checked.num_rows
        stamp = now_us()
        with self._cond:
            self._check_usable()
            first = self._next_seq
            self._cut_event_chunk()
            seq = pa.array(np.arange(first, first + n, dtype=np.int64))
            ts = pa.repeat(pa.scalar(stamp, pa.int64()), n).cast(TS_TYPE)
            full = pa.RecordBatch.from_arrays(
                [seq, ts, *checked.columns],
                schema=pa.schema([self._schema.field("seq"), self._schema.field("ts"), *checked.schema],
                                 metadata=self._schema.metadata),
            )
            self._chunks.append(full)
            self._next_seq += n
            self._pending_first = self._next_seq
        return SeqRange(first, first + n - 1)

    def _cut_event_chunk(self) -> None:
        if self._pending_events:
            self._chunks.append((self._pending_events, self._pending_stamps, self._pending_first))
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
        parts: list = []
        size = 0
        for chunk in chunks:
            if isinstance(chunk, tuple):
                events, stamps, first = chunk
                batch = encode(events, first, stamps, run_id=self.run_id)
            else:
                batch, first = chunk, chunk.column(0)[0].as_py()
            frame = batch_frame_parts(batch, first, self._schema)
            frame_size = sum(len(memoryview(p)) for p in frame)
            if self._offset + size >= self.segment_bytes:
                _write_all(self._fd, parts)
                os.fdatasync(self._fd)
                self._rotate(first)
                parts, size = [], 0
            parts.extend(frame)
            size += frame_size
        if parts:
            _write_all(self._fd, parts)
            os.fdatasync(self._fd)
            self._offset += size

    def _rotate(self, first_seq: int) -> None:
        old = self._segment
        os.close(self._fd)
        self._open_segment(first_seq)
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


def _write_all(fd: int, parts: list) -> None:
    """``writev`` that finishes partial writes (the kernel may write fewer bytes than asked)."""
    views = [memoryview(p).cast("B") for p in parts]
    while views:
        written = os.writev(fd, views[:1024])
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
        from gyre.log.seal import seal_segment

        while (segment := self._queue.get()) is not None:
            try:
                seal_segment(segment)
            except (LogError, OSError, pa.ArrowException) as error:
                log.error("could not seal %s (queries fall back to its frames): %s", segment, error)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
