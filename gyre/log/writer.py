"""The single writer of a log: append, group commit, rotation, crash recovery.

Durability contract: ``append`` assigns seqs and buffers in memory; ``commit`` writes every buffered
event as framed batches and fdatasyncs before it returns. An acknowledged (committed) event is never
lost; a crash loses at most what was not acknowledged, and the next writer continues the gapless seq
from the last event that reached the disk whole.

Group commit is a two-stage pipeline, as in MySQL's binlog group commit:

- **write**: a committer takes *everything* buffered so far (every producer's events) and writes it with
  one ``pwritev``; one writer at a time, so frames reach the file in seq order, and committers whose
  events are in a write under way only wait for it;
- **sync**: the committer fdatasyncs itself when no sync is under way; otherwise the writer's flusher
  thread syncs everything written as soon as the current sync ends, and wakes every committer it covered.

The next group's framing (producer threads, holding the GIL) and writing (a memory copy that releases
it) overlap the current group's fsync, so the disk is seldom idle; ``commit(wait=False)`` lets a producer
go on appending meanwhile. Making each committer in turn the leader that both writes and syncs measured
about 0.5 of a raw write + fsync of the same bytes on 2 cores; the pipeline with a non-waiting producer
measured 0.86 to 1.3 (docs/benchmarks.md).
"""

import errno
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
from gyre.events.codec import (
    ROWS_ENCODE_BELOW,
    check_events,
    encode,
    encode_json_rows,
    now_us,
    stamped_ts,
    validated_columns,
)
from gyre.events.models import Event
from gyre.events.schema import event_schema
from gyre.log.frames import FORMAT_V1, FORMATS, OpenHead, TailVerdict, close_frame
from gyre.log.segment import (
    SegmentData,
    batch_frame_parts,
    fsync_path,
    list_segments,
    quarantine,
    rows_frame_parts,
    schema_frame,
    segment_name,
)

log = logging.getLogger(__name__)

LOCK_FILE = "LOCK"
_INT64 = pa.int64()
DEFAULT_SEGMENT_BYTES = 64 << 20
PREALLOCATE_BYTES = 1 << 20
"""Zeros kept written ahead of the live segment's end (`LogWriter`'s ``preallocate_bytes``)."""
MAX_FRAME_ROWS = 65_536
MAX_FRAME_BYTES = 8 << 20
"""Frames are bounded (a batch is split into frames of at most this many rows and about this many bytes;
one row is never split): one damaged frame can never hold a whole run."""


class SeqRange(NamedTuple):
    """Inclusive range of seqs given to one append (``last < first`` for an empty append)."""

    first: int
    last: int


class LogRecoveryWarning(UserWarning):
    """Opening a log moved damaged bytes at its end (a torn tail, or bytes nothing proves acknowledged)
    into a quarantine file."""


@dataclass(frozen=True)
class Recovery:
    segment: str | None
    dropped_bytes: int
    """Bytes moved from the end of the newest segment into ``quarantined``."""
    next_seq: int
    quarantined: str | None = None
    tail: TailVerdict | None = None


@dataclass
class WriterStats:
    fsyncs: int = 0
    bytes: int = 0
    disk_full_s: float = 0.0
    """Seconds writes waited for space on a full disk."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_POLL_S = 0.5
"""How often a write that found the disk full tries again (the space comes back from outside: no event)."""


@dataclass
class _EventRun:
    """Consecutive events appended one at a time: encoded as one batch when committed."""

    first_seq: int
    events: list[Event]
    stamps: list[int]


class _ReadyFrame:
    """A batch framed in its producer's thread (``append_batch``): the writer only writes it.

    Its place in seq order is taken before it is framed; ``parts`` stays None until the frame is built.
    A v1 frame's first part is an ``OpenHead`` that the writer seals with its durable watermark.
    """

    __slots__ = ("first_seq", "parts", "size")

    def __init__(self, first_seq: int, parts: list | None = None) -> None:
        self.first_seq = first_seq
        self.parts = None
        self.size = 0
        if parts is not None:
            self.fill(parts)

    def fill(self, parts: list) -> None:
        head = parts[0]
        self.size = sum(len(memoryview(p)) for p in parts[1:]) + len(head.buffer if type(head) is OpenHead else head)
        self.parts = parts  # last: whoever sees parts sees the size


def _frame_rows(rows: int, nbytes: int) -> int:
    """Rows per frame that keep a batch of ``rows`` rows and ``nbytes`` bytes within the frame bounds."""
    if rows <= MAX_FRAME_ROWS and nbytes <= MAX_FRAME_BYTES:
        return rows
    # Aim at 7/8 of the bound: rows differ in size, and the IPC message adds offsets and padding.
    return max(1, min(MAX_FRAME_ROWS, rows * (MAX_FRAME_BYTES - MAX_FRAME_BYTES // 8) // max(nbytes, 1)))


@lru_cache(maxsize=256)
def _stored_schema(names: tuple[str, ...]) -> pa.Schema:
    """The schema of a validated producer batch (columns ``names``) with the ``seq`` and ``ts`` it gets."""
    full = event_schema()
    return pa.schema([full.field(n) for n in ("seq", "ts", *(n for n in names if n != "ts"))], metadata=full.metadata)


def _with_run_id(columns: dict[str, pa.Array], rows: int, run_id: str, schema: pa.Schema) -> dict[str, pa.Array]:
    """Stamp the writer's run id where the producer left it empty (as ``encode`` does for events)."""
    current = columns.get("run_id")
    if current is not None and current.null_count == 0:
        return columns
    stamp = pa.scalar(run_id, pa.string())
    stamped = {**columns, "run_id": pa.repeat(stamp, rows) if current is None else pc.fill_null(current, stamp)}
    return {f.name: stamped[f.name] for f in schema if f.name in stamped}  # schema order


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
        max_unsynced_bytes: int = 2 << 20,
        frame_format: int = FORMAT_V1,
        row_frames: bool = True,
        preallocate_bytes: int = PREALLOCATE_BYTES,
    ) -> None:
        """``frame_format`` 0 writes the framing of Gyre before format v1 (no chunk checksums, watermark or
        close marker): kept for the log benchmark's A/B of the two writers, not for production use.

        ``row_frames``: a run of fewer than ``ROWS_ENCODE_BELOW`` events appended one at a time (a model
        call's commit) is framed as its rows in JSON (`rows_frame_parts`), which readers turn into the same
        batch; False frames it as an Arrow IPC message, as every writer did before #33 (format v0 always
        does).

        ``preallocate_bytes``: the live segment is kept written with this many zeros past its last frame
        (extended by the write that reaches them, in the same ``pwritev``), so that a commit overwrites
        allocated blocks of a file whose size does not change: its fdatasync then flushes data alone, without
        a journal commit for the new size and blocks (ext4: one sleep fewer a commit, ~1 voluntary context
        switch of 3). Readers and recovery take zeros after the last frame for the end (`SegmentData.scan`);
        a rotation or a clean close cuts them. 0 appends as before."""
        if frame_format not in FORMATS:
            raise ValueError(f"frame_format must be one of {FORMATS}, not {frame_format}")
        self.frame_format = frame_format
        self.row_frames = row_frames and frame_format == FORMAT_V1
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.segment_bytes = segment_bytes
        self.preallocate_bytes = max(0, preallocate_bytes) if frame_format == FORMAT_V1 else 0
        self._zeros = bytes(self.preallocate_bytes)
        self._zeroed_end = 0
        """The live segment's size: zeros lie from ``_offset`` to here (preallocated)."""
        self.group_commit_window_s = group_commit_window_s
        self.max_pending_events = max_pending_events
        self.max_unsynced_bytes = max_unsynced_bytes
        self._schema = event_schema()
        self._lock_fd = self._acquire_lock()
        self._lock = threading.Lock()
        """Guards seqs, buffers and the written / durable marks; never held across I/O."""
        self._cond = threading.Condition(self._lock)
        """Committers wait on it for ``_durable_seq`` to reach their target."""
        self._work = threading.Condition(self._lock)
        """The flusher waits on it for written events that a committer wants durable."""
        self._framed = threading.Condition(self._lock)
        """A writer waits on it for frames whose seqs it took but whose producers still build them."""
        self._write_turn = threading.Condition(self._lock)
        """Committers wait on it for the current write to end, to write what it did not cover."""
        self._sync_lock = threading.Lock()
        """Held around an fdatasync and by rotation, so a segment's fd is never closed mid-sync."""
        self._pending_events: list[Event] = []
        self._pending_stamps: list[int] = []
        self._pending_first = 0
        self._chunks: list[_ReadyFrame | _EventRun] = []
        self.stats = WriterStats()
        self._stopping = False
        self._closing = False
        self._synced_bytes = 0
        """``stats.bytes`` as of the last fdatasync: what lies beyond it is written but not yet durable."""
        self._failed: BaseException | None = None
        self._closed = False
        self._fd = -1
        self._sealer: _Sealer | None = None
        try:
            self._sealer = _Sealer(self.path) if seal else None
            self.recovery = self._recover()
        except BaseException:
            if self._sealer is not None:
                self._sealer.close()
            if self._fd >= 0:
                os.close(self._fd)
            self._release_lock()
            raise
        self._next_seq = self.recovery.next_seq
        self._durable_seq = self._next_seq - 1
        self._written_seq = self._durable_seq
        self._writing_upto: int | None = None
        """While a committer writes a group: the last seq of that group (one writer at a time)."""
        self._requested = self._durable_seq
        """The highest seq a commit asked the flusher to make durable."""
        self._pending_first = self._next_seq
        self._flusher: threading.Thread | None = None
        """Started by the first commit that leaves its sync to it (one thread and one caller: never)."""

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
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)  # closing the file releases the lock too
            raise
        return fd

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1

    def _recover(self) -> Recovery:
        """Find where the log ends. Corruption raises (nothing is touched); damage at the end of the newest
        segment that a crash can leave, or that nothing proves acknowledged, is moved to a quarantine
        file beside the segment, never deleted (see ``classify_tail`` for which is which)."""
        segments = list_segments(self.path)
        while segments:
            first_seq, path = segments[-1]
            data = SegmentData(path)
            found = data.scan(tail_ok=True)
            if found.schema is None:
                # Crashed while creating this segment: it holds no event. Keep its bytes, drop the file.
                if found.tail is not None:
                    self._quarantine(path, found.tail)
                path.unlink()
                fsync_path(self.path)
                segments.pop()
                continue
            dropped, moved = 0, None
            if found.tail is not None:
                dropped, moved = found.tail.size, self._quarantine(path, found.tail)
            batches = [f for f in found.frames[1:] if f.count]
            next_seq = found.next_seq if found.next_seq is not None else first_seq
            if self._sealer is not None:
                for _, older in segments[:-1]:
                    self._sealer.submit(older)
            if batches:  # the crashed writer may have written it without syncing: it is durable from now
                fsync_path(path)
            same_schema = found.schema.equals(self._schema, check_metadata=True)
            if same_schema:
                self._fd = os.open(path, os.O_WRONLY)
                self._offset = found.valid_end
                self._zeroed_end = found.size if found.tail is None else found.valid_end
                self._segment, self._segment_first = path, first_seq
            elif not batches:  # an empty segment of an older schema: replace it
                path.unlink()
                self._open_segment(next_seq)
            else:  # older schema: leave it sealed, continue in a new segment
                if self._sealer is not None:
                    self._sealer.submit(path)
                self._open_segment(next_seq)
            return Recovery(path.name, dropped, next_seq, moved.name if moved else None, found.tail)
        self._open_segment(0)
        return Recovery(None, 0, 0)

    def _quarantine(self, path: Path, tail: TailVerdict) -> Path:
        moved = quarantine(path, tail)
        held = f"{tail.frames} frame(s) holding {tail.events} event(s) by their headers"
        if tail.verdict == "torn":
            message = (f"log {self.path}: cut a torn tail of {tail.size} bytes from {path.name} at byte offset "
                       f"{tail.offset} ({held}; a write that never finished, so no acknowledged event was in "
                       f"it): {tail.reason}. The bytes are kept in {moved.name}")
        else:
            message = (f"log {self.path}: moved {tail.size} damaged bytes at the end of {path.name} (byte offset "
                       f"{tail.offset}; {held}) to {moved.name}: {tail.reason}. Nothing proves whether they "
                       f"were acknowledged: check them before deleting that file")
        warnings.warn(message, LogRecoveryWarning, stacklevel=4)
        log.warning(message)
        return moved

    def _open_segment(self, first_seq: int) -> None:
        path = self.path / segment_name(first_seq)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        header = schema_frame(self._schema, first_seq, self.frame_format)
        try:
            _write_all(fd, [header], 0)
            os.fsync(fd)
            fsync_path(self.path)
        except BaseException:
            os.close(fd)  # a segment with an incomplete schema frame is removed by the next recovery
            raise
        self._fd, self._offset, self._segment, self._segment_first = fd, len(header), path, first_seq
        self._zeroed_end = len(header)

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
                if self._closing or self._failed is not None:
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
        """Columnar fast path: append a producer-built batch (envelope ids, ``kind``, payload structs, and
        optionally ``ts``: a row's own time is kept, a null or absent one becomes the time of this append).

        It is validated before it gets seqs (a bad batch raises and nothing is buffered). A batch beyond
        ``MAX_FRAME_ROWS`` / ``MAX_FRAME_BYTES`` becomes several frames. It is framed here, in the
        producer's thread and outside the writer's lock, once its seqs are taken: framing
        overlaps other producers' framing, the current write and the current fsync.
        """
        columns = validated_columns(batch)
        n = len(columns["kind"])
        if not n:  # nothing to frame (a 0-row frame would be a batch that readers must skip)
            with self._lock:
                self._check_usable()
                return SeqRange(self._next_seq, self._next_seq - 1)
        per_frame = _frame_rows(n, sum(c.nbytes for c in columns.values()) + 16 * n)  # + seq and ts
        if self.run_id is not None:
            columns = _with_run_id(columns, n, self.run_id, self._schema)
        stamp = now_us()
        with self._lock:
            self._check_usable()
            first = self._next_seq
            self._cut_event_chunk()
            frames = [_ReadyFrame(first + start) for start in range(0, n, per_frame)]
            self._chunks.extend(frames)
            self._next_seq += n
            self._pending_first = self._next_seq
        try:
            seq = pa.Array.from_buffers(_INT64, n, [None, pa.py_buffer(np.arange(first, first + n, dtype=np.int64))])
            ts = stamped_ts(columns.pop("ts", None), n, stamp)
            full = pa.RecordBatch.from_arrays([seq, ts, *columns.values()], schema=_stored_schema(tuple(columns)))
            for frame in frames:  # each fill is atomic: a writer may write that frame from then on
                part = full if len(frames) == 1 else full.slice(frame.first_seq - first, per_frame)
                frame.fill(batch_frame_parts(part, frame.first_seq, self._schema, self.frame_format))
        except BaseException as error:  # its seqs are taken: without this frame the log cannot stay gapless
            self._fail(error)
            raise
        with self._lock:
            self._framed.notify_all()  # (a writer waiting for it also looks again every 50 ms)
        return SeqRange(first, first + n - 1)

    def _cut_event_chunk(self) -> None:
        if self._pending_events:
            self._chunks.append(_EventRun(self._pending_first, self._pending_events, self._pending_stamps))
            self._pending_events, self._pending_stamps = [], []
        self._pending_first = self._next_seq

    # -- committing --------------------------------------------------------------------------------------

    def commit(self, upto: int | None = None, *, wait: bool = True) -> int:
        """Make every event appended so far (or up to seq ``upto``) durable; return the durable seq.

        The caller writes what is buffered (the write stage), then syncs it itself when no sync is under
        way, or waits for the flusher's: handing an fsync to another thread and back costs two thread
        wake-ups, 0.15 ms a commit on a 2-core VM. (With a ``group_commit_window_s`` every sync is the
        flusher's, which first waits that long for more commits to join.)

        With ``wait=False`` the caller writes, asks the flusher for the sync and returns: a producer that
        goes on appending keeps the CPU busy while the disk syncs. A later ``commit()`` (or
        ``durable_seq``) tells when the events are durable. It does wait while more than
        ``max_unsynced_bytes`` are written but not durable: that bounds what a machine crash can take back
        and the size of a group (unbounded, the producer ran megabytes ahead of the disk and the groups
        grew until the memory copies, not the fsync latency, set the pace: 0.93–0.98 of the raw speed
        against 1.07–1.16 with the bound). (Leaving the write to the flusher as well was
        measured slower on 2 cores: the producer then runs ahead and the groups grow to megabytes, where a
        raw write is bound by memory copies, not by the fsync latency the log hides its work behind.)
        """
        with self._lock:
            target = self._next_seq - 1 if upto is None else upto
            if target >= self._next_seq:
                raise ValueError(f"commit(upto={target}): the last appended seq is {self._next_seq - 1}")
            if self._durable_seq >= target:
                return self._durable_seq
            self._check_failed()
            if self._closed:
                raise LogClosedError(f"log writer for {self.path} is closed")
            self._write_stage(target, covered_by_a_write_under_way=True)
            if not wait:
                self._request_sync(target)
                while self.stats.bytes - self._synced_bytes > self.max_unsynced_bytes and self._durable_seq < target:
                    self._check_failed()
                    self._cond.wait()
                return self._durable_seq
            written = self._written_seq >= target  # else a write under way covers it: sync after it
        if written and self.group_commit_window_s == 0 and self._sync_lock.acquire(blocking=False):
            try:
                self._sync()
            finally:
                self._sync_lock.release()
        with self._lock:
            if self._durable_seq < target:
                self._request_sync(target)
            while self._durable_seq < target:
                self._check_failed()
                self._cond.wait()
            return self._durable_seq

    def write(self, upto: int | None = None) -> None:
        """The write stage of `commit` alone: every event up to seq ``upto`` (default: all appended) is in
        the file, or in a group another thread is writing, on return; not yet durable. The caller then
        asks `commit` for the fdatasync, perhaps from another thread (`gyre.sink.LogSink` writes on an
        event loop and syncs on its committer thread)."""
        with self._lock:
            target = self._next_seq - 1 if upto is None else upto
            if target >= self._next_seq:
                raise ValueError(f"write(upto={target}): the last appended seq is {self._next_seq - 1}")
            self._check_failed()
            if self._closed:
                raise LogClosedError(f"log writer for {self.path} is closed")
            self._write_stage(target, covered_by_a_write_under_way=True)

    def _write_stage(self, target: int, covered_by_a_write_under_way: bool) -> None:
        """Return once seq ``target`` is written (or, if ``covered_by_a_write_under_way``, is in a group
        that another thread is writing), writing everything buffered when no one else is. Holds ``_lock``."""
        while True:
            self._check_failed()
            if self._written_seq >= target or self._durable_seq >= target:
                return
            if self._writing_upto is None:
                self._write_group()
                return
            if covered_by_a_write_under_way and self._writing_upto >= target:
                return
            self._write_turn.wait()

    def _request_sync(self, target: int) -> None:
        if target > self._requested:
            self._requested = target
            if self._flusher is None and not self._stopping:
                self._flusher = threading.Thread(target=self._flush_loop, name="gyre-log-flusher", daemon=True)
                self._flusher.start()
            self._work.notify()

    def _write_group(self) -> None:
        """Write everything buffered (anyone's), in seq order. Called holding ``_lock``, which it releases
        while it frames events and writes, and holds again when it returns (or raises)."""
        self._cut_event_chunk()
        chunks, self._chunks = self._chunks, []
        last = self._writing_upto = self._next_seq - 1
        try:
            while any(type(c) is _ReadyFrame and c.parts is None for c in chunks):
                self._framed.wait(0.05)
                self._check_failed()
        except BaseException:  # nothing is written yet: the group goes back for the next writer
            self._chunks[:0] = chunks
            self._writing_upto = None
            self._write_turn.notify_all()
            raise
        self._lock.release()
        error: BaseException | None = None
        try:
            self._write(chunks)
        except BaseException as failed:  # the file holds part of a group: nothing more may follow it
            error = failed
        interrupted = _acquire_uninterruptibly(self._lock)
        self._writing_upto = None
        if error is not None:
            self._fail_locked(error)
            raise error
        self._written_seq = last
        self._write_turn.notify_all()
        if interrupted is not None:
            raise interrupted

    def _write(self, chunks: list) -> None:
        """Write frames in seq order, rotating between frames when the segment is full."""
        parts: list = []
        size = 0
        for chunk in self._frames(chunks):
            if self._offset + size >= self.segment_bytes and chunk.first_seq > self._segment_first:
                self._write_parts(parts, size)
                self._rotate(chunk.first_seq)
                parts, size = [], 0
            head = chunk.parts[0]
            if type(head) is OpenHead:
                # The durable watermark as of now (read without the lock: a stale value is lower, still
                # true): a later frame vouches that the earlier ones were acknowledged.
                head = head.seal(self._durable_seq)
            parts.append(head)
            parts.extend(chunk.parts[1:])
            size += chunk.size
        if parts:
            self._write_parts(parts, size)

    def _frames(self, chunks: list) -> Iterable[_ReadyFrame]:
        """The group's frames in seq order: event runs are encoded here, in bounded frames."""
        for chunk in chunks:
            if type(chunk) is _ReadyFrame:
                yield chunk
                continue
            if self.row_frames and len(chunk.events) < ROWS_ENCODE_BELOW:  # (a model call's commit)
                rows = encode_json_rows(chunk.events, chunk.first_seq, chunk.stamps, run_id=self.run_id)
                if rows is not None and len(rows[0]) <= MAX_FRAME_BYTES:
                    yield _ReadyFrame(chunk.first_seq, rows_frame_parts(*rows, len(chunk.events), chunk.first_seq,
                                                                        self._schema))
                    continue
            batch = encode(chunk.events, chunk.first_seq, chunk.stamps, run_id=self.run_id)
            per_frame = _frame_rows(batch.num_rows, batch.nbytes)
            for start in range(0, batch.num_rows, per_frame):
                part = batch if per_frame >= batch.num_rows else batch.slice(start, per_frame)
                first = chunk.first_seq + start
                yield _ReadyFrame(first, batch_frame_parts(part, first, self._schema, self.frame_format))

    def _write_parts(self, parts: list, size: int) -> None:
        """Write at the segment's end; on a full disk, wait for space and write the same bytes again.

        A positional write that failed part-way leaves bytes past the last durable frame that the retry
        overwrites (or, after a crash, recovery cuts as a torn tail): nothing acknowledged is touched, and
        nothing is acknowledged while the disk is full, so producers wait (remote ones keep their spill)."""
        started = None
        end = self._offset + size
        if end > self._zeroed_end and self.preallocate_bytes:  # the zeros ahead run out: write more with these
            parts = [*parts, self._zeros]
        while True:
            try:
                _write_all(self._fd, parts, self._offset)
                break
            except OSError as error:
                if error.errno not in DISK_FULL or self._stopping:
                    raise
                if parts[-1] is self._zeros:  # the frames first: the zeros ahead are an optimisation
                    parts = parts[:-1]
                if started is None:
                    started = time.monotonic()
                    log.error("log %s: the disk is full; writes wait for space (nothing is lost)", self.path)
                time.sleep(DISK_FULL_POLL_S)
        if started is not None:
            waited = time.monotonic() - started
            self.stats.disk_full_s += waited
            log.warning("log %s: space came back after %.1fs; writing again", self.path, waited)
        self._offset = end
        if parts and parts[-1] is self._zeros:  # written ahead again (kept unless the disk was full)
            self._zeroed_end = end + len(self._zeros)
        else:
            self._zeroed_end = max(self._zeroed_end, end)
        self.stats.bytes += size

    def _flush_loop(self) -> None:
        """The flusher: fdatasync whenever a commit asks for events that are not durable yet and does not
        sync them itself (another sync was under way, or the commit does not wait)."""
        while True:
            with self._work:
                while self._requested <= self._durable_seq and not self._stopping:
                    self._work.wait()
                if self._requested <= self._durable_seq:  # stopping, and nothing left to make durable
                    return
                try:
                    self._write_stage(self._requested, covered_by_a_write_under_way=False)
                except BaseException:
                    return  # the writer failed: every committer learns why
            if self.group_commit_window_s > 0:
                time.sleep(self.group_commit_window_s)
            with self._sync_lock:
                try:
                    self._sync()
                except BaseException:
                    return

    def _sync(self, upto: int | None = None) -> None:
        """fdatasync the segment and publish as durable everything written (or, from a rotation, which
        knows more than the written mark, everything up to seq ``upto``). Called holding ``_sync_lock``."""
        with self._lock:
            # After a failed fsync Linux reports the error once and marks the pages clean: a second
            # fsync would succeed without them. So nothing syncs, or counts as durable, after a failure.
            self._check_failed()
            target = self._written_seq if upto is None else upto  # every frame up to here is in the file
            written_bytes = self.stats.bytes
            if target <= self._durable_seq:
                return
        try:
            os.fdatasync(self._fd)
        except OSError as error:  # fsync errors cannot be retried: the dirty pages may be gone
            self._fail(error)
            raise
        with self._cond:
            self.stats.fsyncs += 1
            self._durable_seq = max(self._durable_seq, target)
            self._synced_bytes = max(self._synced_bytes, written_bytes)
            self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self._fail_locked(error)

    def _fail_locked(self, error: BaseException) -> None:
        """The log accepts nothing more; every waiting and later committer learns why."""
        if self._failed is None:
            log.error("log %s: writing failed, the writer accepts nothing more: %r", self.path, error)
            self._failed = error
        self._cond.notify_all()
        self._write_turn.notify_all()
        self._framed.notify_all()
        self._work.notify()

    def _rotate(self, first_seq: int) -> None:
        """Sync the full segment and continue in a new one (by the thread writing the current group)."""
        with self._sync_lock:
            cut = self._cut_zeros()
            self._sync(first_seq - 1)  # everything in the old segment
            if cut:  # its new size too (were its frames durable already): only the live segment ends in zeros
                try:
                    os.fdatasync(self._fd)
                except OSError as error:
                    self._fail(error)
                    raise
            old, old_fd = self._segment, self._fd
            self._open_segment(first_seq)
            os.close(old_fd)
        if self._sealer is not None:
            self._sealer.submit(old)

    def _cut_zeros(self) -> bool:
        """Truncate the preallocated zeros after the last frame (a segment that is no longer written)."""
        if self._zeroed_end <= self._offset:
            return False
        os.ftruncate(self._fd, self._offset)
        self._zeroed_end = self._offset
        return True

    def _check_usable(self) -> None:
        if self._closing:
            raise LogClosedError(f"log writer for {self.path} is closed")
        self._check_failed()

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise LogClosedError(
                f"log writer for {self.path} failed and accepts nothing more: {self._failed!r}"
            ) from self._failed

    # -- closing -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Commit what was appended, then release the log. Idempotent; appends are refused from the start
        of a close, so nothing accepted is left unwritten."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        try:
            if self._failed is None:
                self.commit()
                self._mark_clean_close()
        finally:
            with self._work:
                self._stopping = True
                self._work.notify()
                flusher = self._flusher
            if flusher is not None:
                flusher.join()
            with self._lock:
                self._closed = True
                fd, self._fd = self._fd, -1
            try:
                if fd >= 0:
                    os.close(fd)
            finally:
                try:
                    if self._sealer is not None:
                        self._sealer.close()
                finally:
                    self._release_lock()

    def _mark_clean_close(self) -> None:
        """Write a CLOSE marker: it vouches that every frame before it was acknowledged, the last one
        included, which no later frame would otherwise do. Not synced: without it, nothing is lost but
        that evidence (the next writer's recovery syncs the segment)."""
        if self.frame_format != FORMAT_V1 or self._fd < 0:
            return
        with self._lock:  # appends are refused and everything is durable: no one else writes now
            if self._failed is not None:
                return
            marker = close_frame(self._next_seq, self._durable_seq)
            offset = self._offset
        try:
            _write_all(self._fd, [marker], offset)
            self._offset = offset + len(marker)
            self._cut_zeros()  # (not synced either: zeros after the marker read as the end as well)
        except OSError as error:
            self._fail(error)
            raise

    def __enter__(self) -> "LogWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _acquire_uninterruptibly(lock: threading.Lock) -> BaseException | None:
    """Take ``lock`` even if a signal handler raises meanwhile (Ctrl-C); return what it raised, if anything,
    for the caller to raise once its state is consistent again."""
    interrupted = None
    while True:
        try:
            lock.acquire()
            return interrupted
        except BaseException as error:
            interrupted = error


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
