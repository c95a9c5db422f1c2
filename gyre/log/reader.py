"""Reading a log: ranged reads, following a live writer from another process, verification, stats.

Readers never take the writer's lock and never modify files. Every batch they return comes from a frame
whose checksum they verified; a partial frame at the end of the newest segment is a write in progress
(or a torn tail the next writer will quarantine) and is simply not returned yet. Damage that the log can
prove was acknowledged is a ``LogCorruptionError`` naming the segment and byte offset.
"""

import threading
import time
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from gyre.errors import LogCorruptionError, LogError
from gyre.events.codec import decode
from gyre.events.models import EVENT_TYPES, Event, event_type
from gyre.events.schema import evolve
from gyre.log.frames import BATCH_FRAME, SCHEMA_FRAME, BadFrame, Frame, scan
from gyre.log.seal import usable_sealed_copy
from gyre.log.segment import SegmentData, list_segments, quarantine_files, sealed_copies

if typing.TYPE_CHECKING:
    import duckdb

MERGE_BYTES = 8 << 20
"""``read`` merges consecutive frames up to about this many stored bytes (bigger frames pass alone)."""


@dataclass
class VerifyReport:
    segments: int = 0
    events: int = 0
    bytes: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    torn_tail_bytes: int = 0
    """Size of the damage at the end of the newest segment (``tail_verdict`` says what it is)."""
    tail_verdict: str | None = None
    """``torn`` (a write that never finished: nothing acknowledged in it), ``ambiguous`` (nothing proves
    whether it was acknowledged), or None (no damage at the end). Corruption raises instead."""
    tail_segment: str | None = None
    tail_offset: int | None = None
    tail_reason: str | None = None
    tail_frames: int = 0
    tail_events: int = 0
    sealed: int = 0
    quarantined: list[str] = field(default_factory=list)
    """Quarantine files left beside segments by earlier recoveries (for a person to look at)."""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No problem and no damaged tail (``torn_tail_ok`` for a log that may end in a torn write)."""
        return not self.problems and self.tail_verdict is None

    @property
    def torn_tail_ok(self) -> bool:
        return not self.problems and self.tail_verdict in (None, "torn")


class LogReader:
    """Read-only view of a log directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise LogError(f"no log at {self.path}: not a directory")
        if not list_segments(self.path):
            raise LogError(f"no log at {self.path}: it holds no segment files (*.seg)")

    def segments(self) -> list[tuple[int, Path]]:
        return list_segments(self.path)

    # -- ranged reads ------------------------------------------------------------------------------------

    def read(self, from_seq: int = 0, to_seq: int | None = None, kinds: Iterable[str] | None = None,
             full_schema: bool = True, batch_rows: int = 65_536) -> Iterator[pa.RecordBatch]:
        """Stream record batches of events with ``from_seq <= seq <= to_seq`` (and ``kinds``), in seq order.

        Batches have the full current schema; with ``full_schema=False`` they keep their stored, sparse
        shape (only the kinds they hold; an older schema's fields), which is cheaper for consumers that read
        columns by name, such as projections. Consecutive small frames of a segment are merged into batches
        of up to ``batch_rows`` rows and about ``MERGE_BYTES``: a log committed call by call holds frames of
        a few events each, and a fixed cost per batch downstream (a projection's fold, a query) would
        otherwise dominate (replaying such a log went from 6K to 24K events/s). Frames of a sixteenth of
        that or more come as they are.
        """
        wanted = _kind_set(kinds)
        segments = self.segments()
        for index, (first_seq, path) in enumerate(segments):
            next_first = segments[index + 1][0] if index + 1 < len(segments) else None
            if next_first is not None and next_first <= from_seq:
                continue
            if to_seq is not None and first_seq > to_seq:
                return
            last = index == len(segments) - 1
            data = SegmentData(path, immutable=not last)
            found = data.scan(verify=False, tail_ok=last)
            pending: list[Frame | pa.RecordBatch] = []
            rows = size = 0
            for frame in data.batch_frames(found):
                if frame.last_seq < from_seq or not frame.count:
                    continue
                if to_seq is not None and frame.first_seq > to_seq:
                    break
                if wanted is not None and not data.has_any_column(frame, wanted):
                    continue
                if not data.check(frame, tail_ok=last):
                    break  # a torn (or unprovable) tail of the newest segment: nothing after it is returned
                item: Frame | pa.RecordBatch = frame  # whole: decoded with the frames merged with it
                count = frame.count
                if frame.first_seq < from_seq or (to_seq is not None and frame.last_seq > to_seq) or wanted:
                    item = _select(data.decode(frame), frame.first_seq, from_seq, to_seq, wanted)
                    count = item.num_rows
                    if not count:
                        continue
                if count * 16 >= batch_rows or len(frame.payload) * 16 >= MERGE_BYTES:
                    if pending:  # a big frame is a good batch already: merging it would only copy it
                        yield _finish(_merge(data.decode_all(pending), data.schema), full_schema)
                        pending, rows, size = [], 0, 0
                    yield _finish(_merge(data.decode_all([item]), data.schema), full_schema)
                    continue
                if pending and (rows + count > batch_rows or size + len(frame.payload) > MERGE_BYTES):
                    yield _finish(_merge(data.decode_all(pending), data.schema), full_schema)
                    pending, rows, size = [], 0, 0
                pending.append(item)
                rows += count
                size += len(frame.payload)
            if pending:
                yield _finish(_merge(data.decode_all(pending), data.schema), full_schema)
            if to_seq is not None and next_first is not None and next_first > to_seq:
                return

    def table(self, from_seq: int = 0, to_seq: int | None = None,
              kinds: Iterable[str] | None = None) -> pa.Table:
        from gyre.events.schema import event_schema

        return pa.Table.from_batches(list(self.read(from_seq, to_seq, kinds)), schema=event_schema())

    def events(self, from_seq: int = 0, to_seq: int | None = None,
               kinds: Iterable[str] | None = None) -> Iterator[Event]:
        """Events as pydantic models (convenient, slower than batches)."""
        for batch in self.read(from_seq, to_seq, kinds):
            yield from decode(batch)

    def last_seq(self) -> int:
        """Seq of the last whole event on disk (-1 for an empty log)."""
        first_seq, path = self.segments()[-1]
        data = SegmentData(path)
        frames = data.batch_frames(data.scan(verify=False, tail_ok=True))
        if frames and not data.check(frames[-1], tail_ok=True):  # the last frame may begin a torn tail
            frames.pop()
        return frames[-1].last_seq if frames else first_seq - 1

    def duckdb(self) -> "duckdb.DuckDBPyConnection":
        """A DuckDB connection with the ``events`` view and one view per kind (see ``gyre.log.query``)."""
        from gyre.log.query import connect

        return connect(self.path)

    # -- following ---------------------------------------------------------------------------------------

    def follow(self, from_seq: int = 0, kinds: Iterable[str] | None = None, poll_s: float = 0.02,
               stop: threading.Event | Callable[[], bool] | None = None,
               idle_timeout_s: float | None = None) -> Iterator[pa.RecordBatch]:
        """Yield batches as the writer (in any process) commits them, from ``from_seq`` on.

        Ends when ``stop`` is set, or after ``idle_timeout_s`` without anything new; otherwise it follows
        forever.
        """
        wanted = _kind_set(kinds)
        should_stop = stop.is_set if isinstance(stop, threading.Event) else (stop or (lambda: False))
        next_seq = from_seq
        segments = self.segments()
        seg_first, path = max((s for s in segments if s[0] <= from_seq), default=segments[0])
        offset, schema = 0, None  # read each segment incrementally: only bytes not seen yet
        idle_since = time.monotonic()
        rotated = False  # a newer segment was seen while this one still ended in something unreadable
        while not should_stop():
            data = SegmentData(path, start=offset, schema=schema)
            stopped_at: BadFrame | None = None
            progressed = False
            whole: list[Frame] = []  # frames taken whole, decoded together (runs of rows frames convert at once)
            for item in scan(data.data, 0, verify=True):
                if isinstance(item, BadFrame):
                    stopped_at = item  # a write in progress, most likely: look again later
                    break
                if whole and (item.frame_type != BATCH_FRAME or len(whole) >= FOLLOW_RUN_FRAMES
                              or item.first_seq < next_seq or wanted is not None):
                    yield evolve(_merge(data.decode_all(whole), data.schema))
                    whole = []
                if item.frame_type == SCHEMA_FRAME:
                    data.schema = pa.ipc.read_schema(pa.py_buffer(item.payload))
                elif item.frame_type == BATCH_FRAME:
                    if item.first_seq >= next_seq and wanted is None:
                        whole.append(item)
                    elif item.last_seq >= next_seq and (wanted is None or data.has_any_column(item, wanted)):
                        batch = evolve(_select(data.decode(item), item.first_seq, next_seq, None, wanted))
                        if batch.num_rows:
                            yield batch
                    next_seq = max(next_seq, item.last_seq + 1)
                offset, schema, progressed = data.start + item.end, data.schema, True
            if whole:
                yield evolve(_merge(data.decode_all(whole), data.schema))
            if progressed:
                idle_since, rotated = time.monotonic(), False
                continue
            newer = [s for s in self.segments() if s[0] > seg_first]
            if newer:  # the writer rotated, so this segment is complete
                if stopped_at is not None and not rotated:
                    rotated = True  # read it once more: what stopped us may be preallocated zeros, cut since
                    continue
                if stopped_at is not None:
                    raise LogCorruptionError(str(path), offset + stopped_at.offset, stopped_at.reason)
                rotated = False
                seg_first, path = newer[0]
                offset, schema = 0, None
                continue
            if idle_timeout_s is not None and time.monotonic() - idle_since > idle_timeout_s:
                return
            time.sleep(poll_s)

    # -- verification ------------------------------------------------------------------------------------

    def verify(self) -> VerifyReport:
        """Check every frame of every segment, the seq chain and the sealed copies; raise on corruption."""
        report = VerifyReport()
        segments = self.segments()
        expected: int | None = None
        for index, (first_seq, path) in enumerate(segments):
            last = index == len(segments) - 1
            data = SegmentData(path)
            found = data.scan(verify=True, tail_ok=last)
            report.segments += 1
            report.bytes += found.size
            if found.tail is not None:
                tail = found.tail
                report.torn_tail_bytes = tail.size
                report.tail_verdict, report.tail_segment, report.tail_offset = tail.verdict, str(path), tail.offset
                report.tail_reason, report.tail_frames, report.tail_events = tail.reason, tail.frames, tail.events
            if found.frames and found.frames[0].first_seq != first_seq:
                raise LogCorruptionError(str(path), 0, f"schema frame says seq {found.frames[0].first_seq}, "
                                                       f"file name says {first_seq}")
            if expected is not None and first_seq != expected:
                raise LogCorruptionError(str(path), 0, f"segment starts at seq {first_seq}, expected {expected}")
            expected = first_seq
            for frame in data.batch_frames(found):
                batch = data.decode(frame)
                seqs = batch.column("seq")
                if batch.num_rows != frame.count or (frame.count and (
                        seqs[0].as_py() != frame.first_seq or seqs[-1].as_py() != frame.last_seq)):
                    raise LogCorruptionError(str(path), frame.offset, "frame header disagrees with its batch")
                report.events += frame.count
                expected = frame.last_seq + 1
            if report.first_seq is None and expected > first_seq:
                report.first_seq = first_seq
            if not last and sealed_copies(path):
                if usable_sealed_copy(path) is not None:
                    report.sealed += 1
                else:
                    report.problems.append(f"{path.name}: sealed copy is damaged or stale (queries use frames)")
        report.last_seq = expected - 1 if expected is not None else None
        report.quarantined = [p.name for p in quarantine_files(self.path)]
        return report


FOLLOW_RUN_FRAMES = 1024
"""`LogReader.follow` decodes at most this many consecutive whole frames together (a catch-up's batches)."""


def _kind_set(kinds: Iterable[str] | None) -> frozenset[str] | None:
    if kinds is None:
        return None
    out = frozenset([kinds] if isinstance(kinds, str) else kinds)
    for kind in out:
        event_type(kind)  # unknown kinds are an error, not an empty result
    return out


def _merge(batches: list[pa.RecordBatch], schema: pa.Schema) -> pa.RecordBatch:
    """One batch of consecutive frames' batches (sparse, maybe of different kinds), in seq order, columns in
    schema order: the union of their columns, null where a frame lacks one.

    Frames with the same columns are concatenated together (Arrow does that in one call however many
    there are), the few resulting tables are unified, and the rows put back in seq order with one sort.
    """
    if len(batches) == 1:
        return batches[0]
    groups: dict[tuple[str, ...], list[pa.RecordBatch]] = {}
    for batch in batches:
        groups.setdefault(tuple(batch.schema.names), []).append(batch)
    if len(groups) == 1:
        return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]
    table = pa.concat_tables([pa.Table.from_batches(g) for g in groups.values()], promote_options="default")
    table = table.select([f.name for f in schema if f.name in table.column_names])
    return table.combine_chunks().sort_by("seq").to_batches()[0]


def _finish(batch: pa.RecordBatch, full_schema: bool) -> pa.RecordBatch:
    return evolve(batch) if full_schema else batch


def _select(batch: pa.RecordBatch, first_seq: int, from_seq: int, to_seq: int | None,
            kinds: frozenset[str] | None) -> pa.RecordBatch:
    start = max(0, from_seq - first_seq)
    stop = batch.num_rows if to_seq is None else min(batch.num_rows, to_seq - first_seq + 1)
    batch = batch.slice(start, max(0, stop - start))
    if kinds is not None:
        # Drop other kinds' payload columns first (free), so the row filter copies only what is kept.
        keep = [n for n in batch.schema.names if n in kinds or n not in EVENT_TYPES]
        batch = batch.select(keep)
        batch = batch.filter(pc.is_in(batch.column("kind"), pa.array(sorted(kinds))))
    return batch

