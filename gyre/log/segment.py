"""Segment files: naming, the schema frame, and batch payloads (column mask + an Arrow IPC message, or the
batch's rows as JSON for a small run of events)."""

import json
import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path

import pyarrow as pa

from gyre.errors import LogCorruptionError
from gyre.events.codec import json_rows, rows_batch
from gyre.log.frames import (
    BATCH_FRAME,
    FLAG_ROWS,
    FORMAT_V1,
    SCHEMA_FRAME,
    BadFrame,
    Frame,
    OpenHead,
    TailVerdict,
    classify_tail,
    frame_header,
    read_frame,
    scan,
    verify_payload,
    zeros_from,
)

SEGMENT_SUFFIX = ".seg"
SEALED_SUFFIX = ".parquet"
QUARANTINE_SUFFIX = ".quarantine"
_MASK_LEN = struct.Struct("<H")


def segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}{SEGMENT_SUFFIX}"


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    """Segments of a log directory as ``(first_seq, path)``, oldest first."""
    out = []
    for path in directory.glob(f"*{SEGMENT_SUFFIX}"):
        stem = path.name[: -len(SEGMENT_SUFFIX)]
        if stem.isdigit():
            out.append((int(stem), path))
    return sorted(out)


def sealed_path(segment: Path, crc: int) -> Path:
    """Sealed copies carry the CRC32C of their own bytes in their name: ``<first_seq>.<crc>.parquet``."""
    return segment.with_name(f"{segment.stem}.{crc:08x}{SEALED_SUFFIX}")


def sealed_copies(segment: Path) -> list[Path]:
    return sorted(segment.parent.glob(f"{segment.stem}.*{SEALED_SUFFIX}"))


def _pad8(n: int) -> int:
    return (8 - n % 8) % 8


def _body_start(mask: bytes) -> int:
    """Where a batch frame's body starts in its payload: after the column mask, padded to 8 bytes."""
    return 2 + len(mask) + _pad8(2 + len(mask))


def schema_frame(schema: pa.Schema, first_seq: int, fmt: int = FORMAT_V1) -> bytes:
    """The first frame of a segment. Its watermark is ``first_seq - 1``: a segment is created only once
    everything before it is durable (a new log, a rotation, a recovery that fsynced the old tail)."""
    payload = schema.serialize().to_pybytes()
    payload += b"\0" * _pad8(len(payload))
    if fmt == FORMAT_V1:
        return bytes(OpenHead(SCHEMA_FRAME, first_seq, 0, [payload]).seal(first_seq - 1)) + payload
    return frame_header(SCHEMA_FRAME, first_seq, 0, [payload]) + payload


def column_mask(batch_schema: pa.Schema, full: pa.Schema) -> bytes:
    # Cached by names and the full schema's identity: hashing an Arrow schema costs more than framing.
    return _column_mask(tuple(batch_schema.names), _SchemaKey(full))


class _SchemaKey:
    __slots__ = ("schema",)

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema

    def __hash__(self) -> int:
        return id(self.schema)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SchemaKey) and other.schema is self.schema


@lru_cache(maxsize=512)
def _column_mask(names: tuple[str, ...], key: _SchemaKey) -> bytes:
    full = key.schema
    bits = bytearray((len(full) + 7) // 8)
    for name in names:
        index = full.get_field_index(name)
        bits[index // 8] |= 1 << (index % 8)
    return bytes(bits)


def batch_frame_parts(batch: pa.RecordBatch, first_seq: int, full: pa.Schema, fmt: int = FORMAT_V1) -> list:
    """Header, column-mask prefix and IPC message of one batch frame, for one ``os.pwritev``. In format v1
    the header is an ``OpenHead``: the writer seals it with its durable watermark when it writes it.

    (Writing the IPC message from the batch's own buffers instead of ``serialize()`` was tried: it saves a
    memcpy but costs a Python call per buffer, and measured no faster.)
    """
    body = batch.serialize()
    return _frame_parts(column_mask(batch.schema, full), memoryview(body), batch.num_rows, first_seq, fmt)


def rows_frame_parts(rows_json: bytes, names: tuple[str, ...], count: int, first_seq: int, full: pa.Schema) -> list:
    """`batch_frame_parts` for a batch given as its rows in JSON (`gyre.events.codec.encode_json_rows`:
    columns ``names``, ``count`` rows): the same frame, flagged ``FLAG_ROWS``, its body the JSON array instead
    of an IPC message (format v1 only)."""
    return _frame_parts(_column_mask(names, _SchemaKey(full)), rows_json, count, first_seq, FORMAT_V1, FLAG_ROWS)


def _frame_parts(mask: bytes, body: memoryview | bytes, count: int, first_seq: int, fmt: int,
                 flags: int = 0) -> list:
    prefix = _MASK_LEN.pack(len(mask)) + mask
    prefix += b"\0" * _pad8(len(prefix))
    parts = [prefix, body]
    if len(body) % 8:
        parts.append(b"\0" * _pad8(len(body)))
    if fmt == FORMAT_V1:
        return [OpenHead(BATCH_FRAME, first_seq, count, parts, flags), *parts]
    return [frame_header(BATCH_FRAME, first_seq, count, parts), *parts]


@dataclass
class SegmentScan:
    """What one pass over a segment found."""

    path: Path
    schema: pa.Schema | None
    frames: list[Frame]
    valid_end: int
    size: int
    """Bytes scanned: up to the file's end, the newest segment's preallocated zeros beyond ``valid_end``
    included."""
    tail: TailVerdict | None = None
    """Damage after the last whole frame of the newest segment: a torn write, or bytes nothing can prove
    either way (``verdict`` says which); None for a clean segment. Corruption raises instead."""
    next_seq: int | None = None
    """The seq after the last whole frame's events."""

    @property
    def torn_bytes(self) -> int:
        return self.tail.size if self.tail is not None else 0


class SegmentData:
    """The bytes of one segment and the decoding of its frames."""

    def __init__(self, path: Path, start: int = 0, schema: pa.Schema | None = None,
                 immutable: bool = False) -> None:
        """Load the segment from byte ``start`` (a follower re-reads only what is new; it passes the
        schema it already has, as the schema frame is at the start).

        ``immutable`` segments (rotated ones: nobody writes or truncates them again) are memory-mapped
        instead of copied; the live segment is read, because a recovering writer may truncate it.
        """
        self.path = path
        self.start = start
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if immutable and start == 0 and size:
                self.raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            else:
                f.seek(start)
                self.raw = f.read()
        self.data = memoryview(self.raw)
        self._schemas: dict[bytes, pa.Schema] = {}
        self._row_types: dict[bytes, pa.StructType] = {}
        self.schema: pa.Schema | None = schema

    def scan(self, verify: bool = True, tail_ok: bool = True) -> SegmentScan:
        """Scan all frames; raise on corruption; report damage at the end (an error unless ``tail_ok``:
        only the newest segment can end in a write that did not finish) as ``tail``.

        Frame offsets are relative to ``start``.
        """
        frames: list[Frame] = []
        valid_end = 0
        tail = None
        expected = None
        for item in scan(self.data, 0, verify=verify):
            if isinstance(item, BadFrame):
                if tail_ok and (frames or self.start) and zeros_from(self.data, item.offset):
                    break  # the live segment's preallocated zeros (`LogWriter`): not written yet, no damage
                tail = self._tail(item, expected, tail_ok)
                break
            if self.start == 0 and not frames:
                if not verify:  # everything decoded from this segment depends on its schema: verify it
                    checked = read_frame(self.data, 0, verify=True)
                    if isinstance(checked, BadFrame):
                        tail = self._tail(checked, expected, tail_ok)
                        break
                if item.frame_type != SCHEMA_FRAME:
                    raise LogCorruptionError(str(self.path), item.offset, "segment does not start with a schema")
                self.schema = pa.ipc.read_schema(pa.py_buffer(item.payload))
                expected = item.first_seq
            elif item.frame_type == SCHEMA_FRAME:
                raise LogCorruptionError(str(self.path), self.start + item.offset, "stray schema frame")
            else:
                if expected is not None and item.first_seq != expected:
                    raise LogCorruptionError(
                        str(self.path), self.start + item.offset,
                        f"sequence gap: frame starts at seq {item.first_seq}, expected {expected}")
                expected = item.first_seq + item.count  # (a CLOSE frame holds no event: count 0)
            frames.append(item)
            valid_end = item.end
        return SegmentScan(self.path, self.schema, frames, valid_end, len(self.data), tail, expected)

    def _tail(self, bad: BadFrame, expected: int | None, tail_ok: bool) -> TailVerdict:
        """Classify damage that ends a scan: raise if it is corruption (or anywhere but the newest segment)."""
        if not tail_ok:
            raise LogCorruptionError(str(self.path), self.start + bad.offset, bad.reason)
        if expected is None:
            stem = self.path.name.split(".")[0]
            expected = int(stem) if stem.isdigit() else 0
        verdict = classify_tail(self.data, bad, expected)
        if verdict.verdict == "corrupt":
            raise LogCorruptionError(str(self.path), self.start + bad.offset, verdict.reason)
        return verdict

    def check(self, frame: Frame, tail_ok: bool = False) -> bool:
        """Verify one frame's checksums (for scans that skipped verification to seek cheaply).

        A bad frame raises ``LogCorruptionError``, unless ``tail_ok`` (the newest segment) and it begins
        damage that is a torn (or unprovable) tail: then False, and neither it nor anything after it is
        to be returned.
        """
        bad = verify_payload(frame)
        if bad is None:
            return True
        self._tail(bad, frame.first_seq, tail_ok)
        return False

    def batch_frames(self, scan_result: SegmentScan) -> list[Frame]:
        """The frames that hold events (not the schema, not CLOSE markers)."""
        return [f for f in scan_result.frames if f.frame_type == BATCH_FRAME]

    def kinds_mask(self, frame: Frame) -> bytes:
        (mask_len,) = _MASK_LEN.unpack_from(frame.payload, 0)
        return bytes(frame.payload[2:2 + mask_len])

    def decode(self, frame: Frame) -> pa.RecordBatch:
        """The (sparse) record batch of a batch frame: zero-copy over the segment bytes for an Arrow IPC
        body (which starts with 0xFFFFFFFF); converted for a JSON rows body (``FLAG_ROWS`` in its header, or,
        in a log written before that flag, a body that starts with ``[``; `rows_frame_parts`: a small run of
        events, as the log writer frames them since #33)."""
        return self.decode_all([frame])[0]

    def decode_all(self, items: Sequence["Frame | pa.RecordBatch"]) -> list[pa.RecordBatch]:
        """`decode` of each frame in ``items`` (a batch passes as it is), in order, except that a run of
        consecutive rows frames comes as one batch per column set, each converted at once (a rows frame's
        conversion has a fixed cost of ~0.1 ms, most of a model call's frame). Those batches hold their rows
        in seq order, but a run whose frames alternate column sets (a call's `model_call_started`, then its
        `model_call_finished`) interleaves them: merge by seq for one order (`LogReader.read` and `follow`
        do; the sealer sorts anyway)."""
        assert self.schema is not None, "scan() the segment before decoding frames"
        out: list[pa.RecordBatch] = []
        run: dict[bytes, list[Frame]] = {}
        for item in items:
            if isinstance(item, pa.RecordBatch):
                self._convert(run, out)
                out.append(item)
                continue
            mask = self.kinds_mask(item)
            body = item.payload[_body_start(mask):]
            if item.rows or body[:1] == b"[":
                run.setdefault(mask, []).append(item)
                continue
            self._convert(run, out)
            try:
                out.append(pa.ipc.read_record_batch(pa.py_buffer(body), self._stored_schema(mask)))
            except (pa.ArrowInvalid, OSError) as error:  # a valid checksum over bytes we cannot decode
                raise LogCorruptionError(str(self.path), self.start + item.offset,
                                         f"undecodable batch: {error}") from error
        self._convert(run, out)
        return out

    def _stored_schema(self, mask: bytes) -> pa.Schema:
        assert self.schema is not None
        schema = self._schemas.get(mask)
        if schema is None:
            fields = [f for i, f in enumerate(self.schema) if mask[i // 8] >> (i % 8) & 1]
            schema = self._schemas[mask] = pa.schema(fields, metadata=self.schema.metadata)
        return schema

    def _convert(self, run: dict[bytes, list[Frame]], out: list[pa.RecordBatch]) -> None:
        """Append the batch of each column set's rows frames in ``run`` to ``out``, and empty ``run``."""
        for mask, frames in run.items():
            schema = self._stored_schema(mask)
            row_type = self._row_types.get(mask)
            if row_type is None:
                row_type = self._row_types[mask] = pa.struct(list(schema))
            rows: list = []
            frame = frames[0]
            try:
                for frame in frames:
                    body = frame.payload[_body_start(mask):]
                    end = len(body)
                    while end and body[end - 1] == 0:  # the frame's padding to 8 bytes
                        end -= 1
                    mine = json_rows(body[:end])
                    if len(mine) != frame.count:
                        raise pa.ArrowInvalid(f"a rows body of {len(mine)} rows in a frame of {frame.count}")
                    rows += mine
                frame = frames[0]
                out.append(rows_batch(rows, row_type, schema.metadata))
            except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError) as error:  # (JSON, base64: ValueError)
                # (the frame whose rows failed, or the run's first when their conversion together did)
                raise LogCorruptionError(str(self.path), self.start + frame.offset,
                                         f"undecodable batch: {error}") from error
        run.clear()

    def has_any_column(self, frame: Frame, names: frozenset[str]) -> bool:
        """Whether a batch frame stores any of the named columns (kinds), without decoding it."""
        assert self.schema is not None
        mask = self.kinds_mask(frame)
        for name in names:
            index = self.schema.get_field_index(name)
            if index >= 0 and mask[index // 8] >> (index % 8) & 1:
                return True
        return False


def fsync_path(path: Path) -> None:
    """fsync a directory (so that the names in it are durable) or a file written through another fd."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def quarantine(segment: Path, tail: TailVerdict) -> Path:
    """Move the bytes from ``tail.offset`` to the end of ``segment`` into a file beside it (with a JSON note
    of the offset and the reason), then cut the segment there. Never deletes: a crash midway leaves the
    bytes in the segment, or in both places, and the next recovery does it again."""
    with open(segment, "r+b") as f:
        f.seek(tail.offset)
        data = f.read()
        target = _quarantine_name(segment, tail.offset, data)
        note = {"segment": segment.name, "offset": tail.offset, "bytes": len(data),
                **{k: v for k, v in asdict(tail).items() if k not in ("offset", "size")},
                "time": datetime.now(UTC).isoformat()}
        for path, content in ((target.with_name(target.name + ".json"), json.dumps(note, indent=1).encode()),
                              (target, data)):
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as out:
                out.write(content)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        fsync_path(segment.parent)
        f.truncate(tail.offset)
        os.fsync(f.fileno())
    return target


def _quarantine_name(segment: Path, offset: int, data: bytes) -> Path:
    """``<segment>.<offset>.quarantine``; the same bytes quarantined again reuse it, other bytes get
    ``<offset>-<n>``."""
    n = 0
    while True:
        name = f"{segment.name}.{offset}{'' if not n else f'-{n}'}{QUARANTINE_SUFFIX}"
        path = segment.with_name(name)
        if not path.exists() or path.read_bytes() == data:
            return path
        n += 1


def quarantine_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{QUARANTINE_SUFFIX}"))
