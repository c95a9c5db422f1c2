"""The on-disk framing of a log segment: every piece of data sits in a checksummed frame.

A frame is a 32-byte header followed by its payload::

    magic "GYRF" | type u8 | flags u8 | reserved u16 | length u32 | count u32 | first_seq i64 |
    crc32c u32 | reserved u32

``crc32c`` covers header bytes 4..24 (everything but the magic and the checksum itself) and the payload,
so a flipped bit anywhere in a frame is caught. Arrow IPC has no checksums of its own; this framing is
the Kafka / SQLite-WAL answer to that.

A segment starts with one SCHEMA frame (the Arrow schema it was written with) and continues with BATCH
frames. A BATCH payload is ``u16 mask_len | column mask | Arrow IPC record-batch message``: the mask says
which of the segment schema's columns the batch carries (kinds absent from a batch are not stored).
"""

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import crc32c

MAGIC = b"GYRF"
HEADER = struct.Struct("<4sBBHIIqII")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 32

SCHEMA_FRAME = 1
BATCH_FRAME = 2
MAX_PAYLOAD = 2**32 - 1


def frame_header(frame_type: int, first_seq: int, count: int, parts: list | tuple) -> bytes:
    """The header of a frame whose payload is ``parts`` concatenated; write it right before them."""
    length = sum(len(memoryview(p)) for p in parts)
    if length > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {length} bytes exceeds the 4 GiB frame limit")
    partial = HEADER.pack(MAGIC, frame_type, 0, 0, length, count, first_seq, 0, 0)
    crc = crc32c.crc32c(partial[4:24])
    for part in parts:
        crc = crc32c.crc32c(part, crc)
    return HEADER.pack(MAGIC, frame_type, 0, 0, length, count, first_seq, crc, 0)


@dataclass(frozen=True, slots=True)
class Frame:
    offset: int
    frame_type: int
    first_seq: int
    count: int
    payload: memoryview

    @property
    def end(self) -> int:
        return self.offset + HEADER_SIZE + len(self.payload)

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.count - 1


@dataclass(frozen=True, slots=True)
class BadFrame:
    """Where scanning stopped, and why. Whether it is a torn tail or corruption is the caller's call."""

    offset: int
    reason: str
    frame_end: int | None
    """End of the bad frame if its header is intact and its length fits in the file, else None."""


def scan(data: memoryview, start: int = 0, verify: bool = True) -> Iterator[Frame | BadFrame]:
    """Yield the frames of ``data`` from ``start``; a ``BadFrame`` ends the scan.

    With ``verify=False`` checksums are skipped (use it only to seek past frames that are not returned).
    """
    size = len(data)
    offset = start
    while offset < size:
        if size - offset < HEADER_SIZE:
            yield BadFrame(offset, f"incomplete frame header ({size - offset} of {HEADER_SIZE} bytes)", None)
            return
        magic, ftype, _flags, _r, length, count, first_seq, crc, reserved = HEADER.unpack_from(data, offset)
        if magic != MAGIC:
            yield BadFrame(offset, f"bad frame magic {bytes(magic)!r}", None)
            return
        if reserved:  # the only header bytes outside the checksum must be zero
            yield BadFrame(offset, f"non-zero reserved header bytes ({reserved:#x})", None)
            return
        end = offset + HEADER_SIZE + length
        if end > size:
            yield BadFrame(offset, f"frame of {length} bytes runs past the end of the file", None)
            return
        payload = data[offset + HEADER_SIZE:end]
        if verify:
            actual = crc32c.crc32c(payload, crc32c.crc32c(data[offset + 4:offset + 24]))
            if actual != crc:
                yield BadFrame(offset, f"checksum mismatch (stored {crc:#010x}, computed {actual:#010x})", end)
                return
        if ftype not in (SCHEMA_FRAME, BATCH_FRAME):
            yield BadFrame(offset, f"unknown frame type {ftype}", end)
            return
        yield Frame(offset, ftype, first_seq, count, payload)
        offset = end


def is_torn_tail(data: memoryview, bad: BadFrame) -> bool:
    """A bad frame is a torn tail when nothing valid follows it: what a crash mid-write leaves behind.

    A bad frame followed by an intact frame (a flipped byte in the middle of a segment) is corruption.
    A damaged *last* frame is indistinguishable from a torn write and is treated as one, as Kafka and
    SQLite's WAL do.
    """
    if bad.frame_end is not None and bad.frame_end < len(data):
        return False
    # The header itself may be damaged: look for any intact frame later in the data.
    position = bad.offset + 1
    while True:
        position = _find(data, MAGIC, position)
        if position < 0:
            return True
        for item in scan(data[position:], 0):
            if isinstance(item, Frame):
                return False
            break
        position += 1


def _find(data: memoryview, needle: bytes, start: int) -> int:
    # memoryview has no find(); bytes(data) would copy the whole segment, so search through the object
    # that owns the memory when it supports find (bytes, mmap), else fall back to a copy of the rest.
    owner = data.obj
    if hasattr(owner, "find") and data.nbytes == len(owner):
        return owner.find(needle, start)
    found = bytes(data[start:]).find(needle)
    return found if found < 0 else start + found
