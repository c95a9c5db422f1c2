"""Segment files: naming, the schema frame, and batch payloads (column mask + Arrow IPC message)."""

import mmap
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pyarrow as pa

from gyre.errors import LogCorruptionError
from gyre.log.frames import BATCH_FRAME, SCHEMA_FRAME, BadFrame, Frame, frame_header, is_torn_tail, scan

SEGMENT_SUFFIX = ".seg"
SEALED_SUFFIX = ".parquet"
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


def schema_frame(schema: pa.Schema, first_seq: int) -> bytes:
    payload = schema.serialize().to_pybytes()
    payload += b"\0" * _pad8(len(payload))
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


def batch_frame_parts(batch: pa.RecordBatch, first_seq: int, full: pa.Schema) -> list:
    """Header, column-mask prefix and IPC message of one batch frame, ready for one ``os.pwritev``.

    (Writing the IPC message from the batch's own buffers instead of ``serialize()`` was tried: it saves a
    memcpy but costs a Python call per buffer, and measured no faster.)
    """
    mask = column_mask(batch.schema, full)
    prefix = _MASK_LEN.pack(len(mask)) + mask
    prefix += b"\0" * _pad8(len(prefix))
    body = batch.serialize()
    parts = [prefix, memoryview(body)]
    if body.size % 8:
        parts.append(b"\0" * _pad8(body.size))
    return [frame_header(BATCH_FRAME, first_seq, batch.num_rows, parts), *parts]


@dataclass
class SegmentScan:
    """What one pass over a segment found."""

    path: Path
    schema: pa.Schema | None
    frames: list[Frame]
    valid_end: int
    size: int
    torn_bytes: int
    """Bytes after the last whole frame that belong to a torn write (0 for a clean segment)."""


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
        self.schema: pa.Schema | None = schema

    def scan(self, verify: bool = True, tail_ok: bool = True) -> SegmentScan:
        """Scan all frames; raise on corruption, report a torn tail (an error unless ``tail_ok``).

        Frame offsets are relative to ``start``.
        """
        frames: list[Frame] = []
        valid_end = 0
        torn = 0
        expected = None
        for item in scan(self.data, 0, verify=verify):
            if isinstance(item, BadFrame):
                if not tail_ok or not is_torn_tail(self.data, item):
                    raise LogCorruptionError(str(self.path), self.start + item.offset, item.reason)
                torn = len(self.data) - item.offset
                break
            if self.start == 0 and not frames:
                if not verify:
                    self.check(item)  # everything decoded from this segment depends on its schema
                if item.frame_type != SCHEMA_FRAME:
                    raise LogCorruptionError(str(self.path), item.offset, "segment does not start with a schema")
                self.schema = pa.ipc.read_schema(pa.py_buffer(item.payload))
                expected = item.first_seq
            elif item.frame_type != BATCH_FRAME:
                raise LogCorruptionError(str(self.path), self.start + item.offset, "stray schema frame")
            else:
                if expected is not None and item.first_seq != expected:
                    raise LogCorruptionError(
                        str(self.path), self.start + item.offset,
                        f"sequence gap: frame starts at seq {item.first_seq}, expected {expected}")
                expected = item.first_seq + item.count
            frames.append(item)
            valid_end = item.end
        return SegmentScan(self.path, self.schema, frames, valid_end, len(self.data), torn)

    def check(self, frame: Frame) -> None:
        """Verify one frame's checksum (for scans that skipped verification to seek cheaply)."""
        for item in scan(self.data[frame.offset:frame.end], 0, verify=True):
            if isinstance(item, BadFrame):
                raise LogCorruptionError(str(self.path), self.start + frame.offset, item.reason)
            return

    def batch_frames(self, scan_result: SegmentScan) -> list[Frame]:
        return [f for f in scan_result.frames if f.frame_type == BATCH_FRAME]

    def kinds_mask(self, frame: Frame) -> bytes:
        (mask_len,) = _MASK_LEN.unpack_from(frame.payload, 0)
        return bytes(frame.payload[2:2 + mask_len])

    def decode(self, frame: Frame) -> pa.RecordBatch:
        """The (sparse) record batch of a batch frame, zero-copy over the segment bytes."""
        assert self.schema is not None, "scan() the segment before decoding frames"
        mask = self.kinds_mask(frame)
        start = 2 + len(mask) + _pad8(2 + len(mask))
        schema = self._schemas.get(mask)
        if schema is None:
            fields = [f for i, f in enumerate(self.schema) if mask[i // 8] >> (i % 8) & 1]
            schema = self._schemas[mask] = pa.schema(fields, metadata=self.schema.metadata)
        try:
            return pa.ipc.read_record_batch(pa.py_buffer(frame.payload[start:]), schema)
        except (pa.ArrowInvalid, OSError) as error:  # a valid checksum over bytes we cannot decode
            raise LogCorruptionError(str(self.path), self.start + frame.offset,
                                     f"undecodable batch: {error}") from error

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
