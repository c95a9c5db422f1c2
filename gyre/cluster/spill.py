"""A process's local, durable buffer of the events the controller has not acknowledged yet.

While the controller is down a cell or the proxy keeps recording; its `RemoteSink` writes what the
controller has not acknowledged here, so a harness call can be answered (its events are durable) and a
kill -9 of the process loses nothing that was answered. The controller stays the run's one log writer: this
is no log, only a hand-over that the next stream (or the next incarnation of the process) re-sends, the
producer stamps making the re-send exactly once.

On disk: one directory per process, segment files of checksummed frames (`gyre.log.spill`, where the audit
reads them too) whose payload is the record's events in the wire's Arrow IPC encoding: one schema for
events everywhere. Appends are fsync'd; each `Spill` writes only segments it opened itself, so a torn frame
(a kill mid-append) can only end a segment: loading stops that segment at its first bad frame, with a warning.
Whole segments are deleted once acknowledged (`drop_upto`); a segment that was acknowledged only in part comes
back on the next load, and the controller drops what it already holds by stamp.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gyre.cluster.errors import ClusterError
from gyre.errors import GyreError
from gyre.events.models import Event
from gyre.events.wire import unpack_events
from gyre.log.spill import SUFFIX, spill_frame, spill_frames

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpilledRecord:
    record_id: int
    events: list[Event]


@dataclass
class _Segment:
    path: Path
    first: int
    last: int  # the last valid record id in it (first - 1: none)
    size: int


def spill_path(run_dir: str | Path, peer_id: str) -> Path:
    """Where a process's spill lives: ``<run_dir>/spill/<peer_id>``."""
    return Path(run_dir) / "spill" / peer_id


class Spill:
    """An append-only, fsync'd store of (record id, events) under ``path``; one process at a time holds it.

    Not thread-safe: one thread (the sink's spill writer) appends and drops. Record ids must increase.
    """

    SEGMENT_BYTES = 64 << 20
    """A segment is rolled once it is this large, so that acknowledged ones can be deleted whole."""

    def __init__(self, path: str | Path, *, segment_bytes: int | None = None) -> None:
        self.path = Path(path)
        self.segment_bytes = segment_bytes or self.SEGMENT_BYTES
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.path / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ClusterError(f"the spill {self.path} is held by another live process (or link): two writers "
                               "would re-send each other's events") from None
        self._segments: list[_Segment] = []
        self._active: _Segment | None = None
        self._file: int | None = None
        self._closed = False
        for segment in self._scan():
            if segment.last < segment.first:  # nothing valid in it: a kill before its first frame was whole
                segment.path.unlink(missing_ok=True)
            else:
                self._segments.append(segment)

    # -- reading -------------------------------------------------------------------------------------------

    def _scan(self) -> list[_Segment]:
        found = []
        for path in self.path.glob(f"*{SUFFIX}"):
            try:
                first = int(path.name[: -len(SUFFIX)])
            except ValueError:
                log.warning("ignoring %s in the spill: not a segment name", path)
                continue
            found.append((first, path))
        segments = []
        for first, path in sorted(found):
            last = first - 1
            size = 0
            for record_id, _, end in spill_frames(path.read_bytes(), path):
                last, size = record_id, end
            segments.append(_Segment(path, first, last, size))
        return segments

    def load(self) -> list[SpilledRecord]:
        """The records still held, in record id order."""
        records: list[SpilledRecord] = []
        for segment in self._segments:
            data = segment.path.read_bytes()
            for record_id, start, end in spill_frames(data, segment.path):
                if end > segment.size:  # past what the scan found valid (never: only this object appends)
                    break
                if records and record_id <= records[-1].record_id:
                    log.warning("ignoring record %d of spill segment %s: not after %d", record_id, segment.path,
                                records[-1].record_id)
                    continue
                try:
                    events = unpack_events(data[start:end])
                except GyreError as e:  # the checksum matched, so this is a bug, not a torn write
                    raise ClusterError(f"spill segment {segment.path}: record {record_id} does not decode: {e}") from e
                records.append(SpilledRecord(record_id, events))
        return records

    @property
    def last_id(self) -> int:
        """The last record id held (0: none)."""
        return self._segments[-1].last if self._segments else 0

    @property
    def empty(self) -> bool:
        return not self._segments

    # -- writing -------------------------------------------------------------------------------------------

    def append(self, records: Sequence[tuple[int, Sequence[Event]]]) -> None:
        """Append records (ids increasing, after every id held) and fsync once: durable when this returns."""
        if self._closed:
            raise ClusterError(f"the spill {self.path} is closed")
        if not records:
            return
        frames = []
        last = self.last_id
        for record_id, events in records:
            if record_id <= last:
                raise ValueError(f"spill record id {record_id} is not after {last}: ids must increase")
            frames.append(spill_frame(record_id, events))
            last = record_id
        if self._active is not None and self._active.size >= self.segment_bytes:
            self._roll()
        if self._active is None:
            self._open(records[0][0])
        assert self._active is not None and self._file is not None
        data = b"".join(frames)
        view = memoryview(data)
        while view:
            written = os.write(self._file, view)
            view = view[written:]
        os.fsync(self._file)
        self._active.size += len(data)
        self._active.last = last

    def _open(self, first: int) -> None:
        path = self.path / f"{first:020d}{SUFFIX}"
        self._file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        self._sync_dir()  # the new name must survive a crash as surely as the frames in it
        self._active = _Segment(path, first, first - 1, 0)
        self._segments.append(self._active)

    def _roll(self) -> None:
        if self._file is not None:
            os.close(self._file)
        self._file = None
        self._active = None

    def _sync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def drop_upto(self, record_id: int) -> None:
        """Forget the records up to ``record_id`` (the controller holds them): deletes the segments they fill."""
        while self._segments and self._segments[0].last <= record_id:
            segment = self._segments.pop(0)
            if segment is self._active:
                self._roll()
            segment.path.unlink(missing_ok=True)  # a deletion lost to a crash only re-sends held events

    def close(self) -> None:
        """Close the files and release the directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._roll()
        os.close(self._lock_fd)
