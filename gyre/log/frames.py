"""The on-disk framing of a log segment: every piece of data sits in a checksummed frame.

Every frame starts with a 32-byte header::

    magic "GYRF" | type u8 | flags u8 | chunk_shift u8 | reserved u8 | length u32 | count u32 |
    first_seq i64 | crc u32 | head_crc u32

``length`` is the payload's size. The format is versioned through ``flags``:

- **v0** (flags 0; written by Gyre before the chunked format, e.g. ``tests/fixtures/log-v0``): the payload
  follows the header; ``crc`` is a CRC32C over header bytes 4..24 and the payload; ``head_crc`` is zero.
- **v1** (``FLAG_CHUNKED``): the header is followed by an *extension*, then the payload. The extension
  holds one CRC32C per ``2**chunk_shift`` bytes of payload, zero padding to 8 bytes, and the writer's
  durable watermark (i64: the highest seq already fsynced when this frame was written). ``crc`` covers
  the extension, ``head_crc`` covers header bytes 4..28: the header verifies on its own (its length can
  be trusted before the rest is read), the extension on its own, and each chunk on its own.
- **rows** (``FLAG_CHUNKED | FLAG_ROWS``, since #33): a v1 BATCH frame whose body is its rows as JSON
  (`gyre.log.segment.rows_frame_parts`) instead of an Arrow IPC message. The flag is what makes a Gyre from
  before say "a newer Gyre wrote this log" (a flag it does not know) instead of "undecodable batch".

Why: a torn write and a damaged durable frame look alike to a whole-frame checksum. Per-chunk checksums
tell them apart (a write that did not finish leaves a bad *suffix*; a flipped bit leaves one bad chunk
between good ones), and the watermark lets a later frame vouch that an earlier one was acknowledged, at
no cost of an fsync. ``classify_tail`` turns that evidence into a verdict.

A segment starts with one SCHEMA frame (the Arrow schema it was written with) and continues with BATCH
frames (``u16 mask_len | column mask | Arrow IPC record-batch message``: the mask says which of the
segment schema's columns the batch carries) and CLOSE frames (no payload, v1 only: a writer closed cleanly
here, with everything before it durable).
"""

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import crc32c
import numpy as np

MAGIC = b"GYRF"
HEADER = struct.Struct("<4sBBBBIIqII")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 32
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")

SCHEMA_FRAME = 1
BATCH_FRAME = 2
CLOSE_FRAME = 3
FRAME_TYPES = (SCHEMA_FRAME, BATCH_FRAME, CLOSE_FRAME)
MAX_PAYLOAD = 2**32 - 1

FLAG_CHUNKED = 0x01
"""Format v1: header checksum of its own, per-chunk payload checksums, durable watermark."""
FLAG_ROWS = 0x02
"""A v1 BATCH frame whose body is JSON rows, not an Arrow IPC message (readers from before #33 cannot decode
it: this flag makes them refuse the log as a newer Gyre's). Readers also take an unflagged body that starts
with ``[`` as rows: logs written between #33's rows frames and this flag carry none."""
KNOWN_FLAGS = FLAG_CHUNKED | FLAG_ROWS
FORMAT_V0, FORMAT_V1 = 0, 1
FORMATS = (FORMAT_V0, FORMAT_V1)

CHUNK_SHIFT = 16
"""Chunks of at least 64 KiB. Each chunk is a CRC call from Python, and CRCs of small chunks run slower
per byte than one CRC of the payload: framing a 265 KB batch costs 11 µs of CPU for one CRC, 21 µs in
16 KiB chunks, 16 µs in 64 KiB chunks (4 KiB: +22 µs, ~5% of a blocking producer's write + fsync on the
development VM). A torn write is told from a flipped bit except inside a frame's last chunk."""
MAX_CHUNKS_SHIFT = 5
"""At most 32 chunks a frame (bigger frames get bigger chunks): checksumming many small chunks runs at
about half the speed of one CRC over the whole payload, which a replay of multi-MB frames would feel."""


def chunk_shift(length: int) -> int:
    """log2 of the chunk size for a payload of ``length`` bytes."""
    return max(CHUNK_SHIFT, (max(length, 1) - 1).bit_length() - MAX_CHUNKS_SHIFT)


def _pad8(n: int) -> int:
    return (8 - n % 8) % 8


def chunk_count(length: int, shift: int) -> int:
    return (length + (1 << shift) - 1) >> shift


def ext_size(length: int, shift: int) -> int:
    """Bytes of a v1 frame's extension: chunk checksums, padding, watermark."""
    table = 4 * chunk_count(length, shift)
    return table + _pad8(table) + 8


# -- writing ---------------------------------------------------------------------------------------------


def frame_header(frame_type: int, first_seq: int, count: int, parts: list | tuple) -> bytes:
    """The v0 header of a frame whose payload is ``parts`` concatenated; write it right before them."""
    length = _length(parts)
    partial = HEADER.pack(MAGIC, frame_type, 0, 0, 0, length, count, first_seq, 0, 0)
    crc = crc32c.crc32c(partial[4:24])
    for part in parts:
        crc = crc32c.crc32c(part, crc)
    return HEADER.pack(MAGIC, frame_type, 0, 0, 0, length, count, first_seq, crc, 0)


def _length(parts: list | tuple) -> int:
    length = sum(memoryview(p).nbytes for p in parts)
    if length > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {length} bytes exceeds the 4 GiB frame limit")
    return length


def chunk_checksums(parts: list | tuple, shift: int) -> list[int]:
    """CRC32C of each ``2**shift``-byte chunk of ``parts`` concatenated (without concatenating them)."""
    size = 1 << shift
    out: list[int] = []
    crc = filled = 0
    for part in parts:
        view = memoryview(part).cast("B")
        n, pos = len(view), 0
        if filled:  # finish the chunk the previous part began
            take = min(size - filled, n)
            crc = crc32c.crc32c(view[:take], crc)
            filled += take
            pos = take
            if filled == size:
                out.append(crc)
                crc = filled = 0
        whole = pos + (n - pos) // size * size
        out += [crc32c.crc32c(view[i:i + size]) for i in range(pos, whole, size)]  # (a list: no generator)
        if whole < n:
            crc, filled = crc32c.crc32c(view[whole:]), n - whole
    if filled:
        out.append(crc)
    return out


@lru_cache(maxsize=64)
def _table(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}I")


class OpenHead:
    """A v1 header and extension whose watermark is filled in when the frame is written (``seal``).

    ``partial`` is the extension's CRC up to the watermark, so sealing costs two CRCs of a few bytes.
    """

    __slots__ = ("buffer", "partial")

    def __init__(self, frame_type: int, first_seq: int, count: int, parts: list | tuple, flags: int = 0) -> None:
        """``flags``: besides ``FLAG_CHUNKED`` (always set), ``FLAG_ROWS`` for a rows body."""
        length = _length(parts)
        shift = chunk_shift(length)
        crcs = chunk_checksums(parts, shift)
        table = _table(len(crcs))
        buffer = bytearray(HEADER.pack(MAGIC, frame_type, FLAG_CHUNKED | flags, shift, 0, length, count, first_seq,
                                       0, 0)
                           + table.pack(*crcs) + bytes(8 + _pad8(table.size)))
        self.buffer = buffer
        self.partial = crc32c.crc32c(memoryview(buffer)[HEADER_SIZE:-8])

    def seal(self, watermark: int) -> bytearray:
        """Record ``watermark`` (the durable seq when the frame is written) and the checksums over it."""
        buffer = self.buffer
        _I64.pack_into(buffer, len(buffer) - 8, watermark)
        _U32.pack_into(buffer, 24, crc32c.crc32c(memoryview(buffer)[-8:], self.partial))
        _U32.pack_into(buffer, 28, crc32c.crc32c(memoryview(buffer)[4:28]))
        return buffer


def close_frame(next_seq: int, durable_seq: int) -> bytes:
    """The marker a writer leaves on a clean close: everything up to ``durable_seq`` is durable."""
    return bytes(OpenHead(CLOSE_FRAME, next_seq, 0, []).seal(durable_seq))


# -- reading ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Frame:
    offset: int
    frame_type: int
    first_seq: int
    count: int
    payload: memoryview
    end: int
    watermark: int | None = None
    """v1: the highest seq durable when the frame was written (-1: none); v0: unknown."""
    chunk_shift: int = 0
    chunk_crcs: memoryview | None = None
    """v1: the extension's chunk checksums (u32 each); None for v0 frames, which have one CRC."""
    crc: int = 0
    rows: bool = False
    """The header says the body is JSON rows (``FLAG_ROWS``)."""

    @property
    def last_seq(self) -> int:
        return self.first_seq + self.count - 1

    @property
    def chunked(self) -> bool:
        return self.chunk_crcs is not None


BadKind = Literal["short", "short_verified", "header", "extension", "extension_consistent", "payload",
                  "crc", "format"]


@dataclass(frozen=True, slots=True)
class BadFrame:
    """Where scanning stopped, and why. Whether it is a torn tail or corruption is ``classify_tail``'s call.

    ``kind``: ``short`` the data ends inside an unverifiable header or frame; ``short_verified`` the
    header verified and the data ends before the frame does (a write that did not finish); ``header``
    the header does not verify; ``extension`` a v1 chunk table that does not verify;
    ``extension_consistent`` the same, but every chunk matches the table (damage in the watermark or its
    checksum); ``payload`` bad chunks in ``bad_chunks`` of ``chunks``; ``crc`` a v0 frame's checksum;
    ``format`` a frame this version cannot read (unknown flags or type), never a torn write.
    """

    offset: int
    reason: str
    kind: BadKind = "header"
    frame_end: int | None = None
    """End of the bad frame if its header is intact and its length fits in the file, else None."""
    first_seq: int | None = None
    count: int | None = None
    bad_chunks: tuple[int, ...] = ()
    chunks: int = 0


def read_frame(data: memoryview, offset: int, verify: bool = True) -> Frame | BadFrame:
    """The frame at ``offset``. v1 headers and extensions are always verified (cheap); payloads (v1 chunks,
    v0 whole frames) only with ``verify``."""
    size = len(data)
    if size - offset < HEADER_SIZE:
        return BadFrame(offset, f"incomplete frame header ({size - offset} of {HEADER_SIZE} bytes)", "short")
    magic, ftype, flags, shift, _r, length, count, first_seq, crc, head_crc = HEADER.unpack_from(data, offset)
    if magic != MAGIC:
        return BadFrame(offset, f"bad frame magic {bytes(magic)!r}", "header")
    if flags & ~KNOWN_FLAGS:
        if ftype in FRAME_TYPES and not _r:  # a well-formed header of a format this version does not know
            return BadFrame(offset, f"unknown frame format flags {flags:#x} (a newer Gyre wrote this log?)",
                            "format")
        return BadFrame(offset, f"unknown frame format flags {flags:#x} in a damaged header", "header")
    if not flags & FLAG_CHUNKED:
        if zeros_from(data[:offset + HEADER_SIZE], offset + 5):  # never a v0 header (its crc is not 0)
            return BadFrame(offset, "a frame header that is zeros after its first bytes (a write that did not "
                                    "finish)", "header")
        if flags & FLAG_ROWS:  # (only v1 frames are ever written as rows)
            return BadFrame(offset, f"frame format flags {flags:#x}: rows without chunk checksums", "header")
        return _read_v0(data, offset, ftype, length, count, first_seq, crc, head_crc, verify)
    if crc32c.crc32c(data[offset + 4:offset + 28]) != head_crc:
        return BadFrame(offset, "frame header checksum mismatch", "header")
    if ftype not in FRAME_TYPES:
        return BadFrame(offset, f"unknown frame type {ftype}", "format")
    if flags & FLAG_ROWS and ftype != BATCH_FRAME:
        return BadFrame(offset, f"a frame of type {ftype} flagged as rows (only batch frames hold rows)", "format")
    start = offset + HEADER_SIZE
    body = start + ext_size(length, shift)
    end = body + length
    if end > size:
        return BadFrame(offset, f"frame of {length} bytes runs past the end of the data ({size - offset - HEADER_SIZE} "
                                f"bytes after its header): a write that did not finish", "short_verified",
                        first_seq=first_seq, count=count)
    n = chunk_count(length, shift)
    table = data[start:start + 4 * n]
    payload = data[body:end]
    if crc32c.crc32c(data[start:body]) != crc:
        kind: BadKind = "extension_consistent" if not _bad_chunks(payload, table, shift) else "extension"
        return BadFrame(offset, "frame extension (chunk checksums, watermark) checksum mismatch", kind, end,
                        first_seq, count)
    if verify:
        bad = _bad_chunks(payload, table, shift)
        if bad:
            return BadFrame(offset, f"checksum mismatch in {len(bad)} of {n} chunks of {1 << shift} bytes "
                                    f"(first: chunk {bad[0]})", "payload", end, first_seq, count, tuple(bad), n)
    (watermark,) = _I64.unpack_from(data, body - 8)
    return Frame(offset, ftype, first_seq, count, payload, end, watermark, shift, table, crc,
                 bool(flags & FLAG_ROWS))


def _read_v0(data: memoryview, offset: int, ftype: int, length: int, count: int, first_seq: int, crc: int,
             reserved: int, verify: bool) -> Frame | BadFrame:
    if reserved:  # the only header bytes outside the checksum must be zero
        return BadFrame(offset, f"non-zero reserved header bytes ({reserved:#x})", "header")
    end = offset + HEADER_SIZE + length
    if end > len(data):
        return BadFrame(offset, f"frame of {length} bytes runs past the end of the file", "short")
    payload = data[offset + HEADER_SIZE:end]
    if verify:
        actual = crc32c.crc32c(payload, crc32c.crc32c(data[offset + 4:offset + 24]))
        if actual != crc:
            return BadFrame(offset, f"checksum mismatch (stored {crc:#010x}, computed {actual:#010x})", "crc", end)
    if ftype not in (SCHEMA_FRAME, BATCH_FRAME):
        return BadFrame(offset, f"unknown frame type {ftype}", "format", end)
    return Frame(offset, ftype, first_seq, count, payload, end, crc=crc)


def _bad_chunks(payload: memoryview, table: memoryview, shift: int) -> list[int]:
    size = 1 << shift
    stored = struct.unpack(f"<{len(table) // 4}I", table)
    return [i for i, want in enumerate(stored) if crc32c.crc32c(payload[i * size:(i + 1) * size]) != want]


def verify_payload(frame: Frame) -> BadFrame | None:
    """Check a frame returned by an unverified scan; the ``BadFrame`` it would have been, if any."""
    if frame.chunk_crcs is not None:
        bad = _bad_chunks(frame.payload, frame.chunk_crcs, frame.chunk_shift)
        if not bad:
            return None
        n = len(frame.chunk_crcs) // 4
        return BadFrame(frame.offset, f"checksum mismatch in {len(bad)} of {n} chunks of {1 << frame.chunk_shift} "
                                      f"bytes (first: chunk {bad[0]})", "payload", frame.end, frame.first_seq,
                        frame.count, tuple(bad), n)
    head = HEADER.pack(MAGIC, frame.frame_type, 0, 0, 0, len(frame.payload), frame.count, frame.first_seq, 0, 0)
    actual = crc32c.crc32c(frame.payload, crc32c.crc32c(head[4:24]))
    if actual == frame.crc:
        return None
    return BadFrame(frame.offset, f"checksum mismatch (stored {frame.crc:#010x}, computed {actual:#010x})", "crc",
                    frame.end)


def scan(data: memoryview, start: int = 0, verify: bool = True) -> Iterator[Frame | BadFrame]:
    """Yield the frames of ``data`` from ``start``; a ``BadFrame`` ends the scan.

    With ``verify=False`` payload checksums are skipped (use it only to seek past frames that are not
    returned, or verify them with ``verify_payload`` before use); v1 headers are verified regardless.
    """
    offset = start
    size = len(data)
    while offset < size:
        item = read_frame(data, offset, verify)
        yield item
        if isinstance(item, BadFrame):
            return
        offset = item.end


# -- torn or corrupt -------------------------------------------------------------------------------------


Verdict = Literal["corrupt", "torn", "ambiguous"]


@dataclass(frozen=True, slots=True)
class TailVerdict:
    """What the bytes from a bad frame to the end of the newest segment are."""

    verdict: Verdict
    offset: int
    size: int
    reason: str
    frames: int = 0
    """Frames in those bytes whose header could be read (v1 headers verified), and their events."""
    events: int = 0


def classify_tail(data: memoryview, bad: BadFrame, expected_seq: int) -> TailVerdict:
    """Is the damage from ``bad`` to the end of ``data`` (the newest segment) a torn write, corruption, or
    something nothing can prove either way? ``expected_seq`` is the seq the bad frame should start at.

    - *corrupt* (an error, nothing is cut): a later intact frame records a durable watermark at or past
      ``expected_seq`` (a CLOSE marker included: the bad bytes were acknowledged); or a later intact frame
      without a watermark (v0), or after a damaged schema frame (which is fsynced when the segment is
      created); or a v1 frame with a bad chunk followed by a good one (a flipped bit: a torn write leaves
      a bad suffix); or a frame this version cannot read.
    - *torn* (proven never acknowledged): fewer bytes than a header, or only zeros; a verified header whose
      frame runs past the end (the write did not finish); two or more bad chunks forming the suffix of a
      frame.
    - *ambiguous*: anything else (a damaged header, only the last chunk bad, a v0 frame's checksum) with
      nothing intact after it; with an intact (unvouching) frame after it, it is *corrupt*: moving intact
      frames on a guess is moving more than the damage.
    """
    size = len(data) - bad.offset
    frames, events = _count_frames(data, bad.offset)

    def verdict(kind: Verdict, reason: str) -> TailVerdict:
        return TailVerdict(kind, bad.offset, size, reason, frames, events)

    if bad.kind == "format":
        return verdict("corrupt", bad.reason)
    later = _later_evidence(data, bad.frame_end if bad.frame_end is not None else bad.offset + 1)
    if later is not None:
        offset, watermark = later
        if watermark is None:
            return verdict("corrupt", f"{bad.reason}; an intact frame follows at byte offset {offset}")
        if watermark >= expected_seq:
            return verdict("corrupt", f"{bad.reason}; the frame at byte offset {offset} was written after "
                                      f"seq {watermark} was durable, so this one was acknowledged")
        if bad.offset == 0:
            return verdict("corrupt", f"{bad.reason}; the schema frame is durable before any other frame")
    found = _pattern(data, bad, size)
    if found[0] == "ambiguous" and later is not None:
        # An intact frame after the damage, written before it was durable (a machine crash can persist
        # pages out of order): moving it too would be moving more than the damage, so it stays an error.
        return verdict("corrupt", f"{found[1]}; an intact frame follows at byte offset {later[0]}")
    return verdict(*found)


def _pattern(data: memoryview, bad: BadFrame, size: int) -> tuple[Verdict, str]:
    """What the damage itself looks like: a torn write, a flipped bit (corrupt), or either."""

    def verdict(kind: Verdict, reason: str) -> tuple[Verdict, str]:
        return kind, reason

    if bad.kind == "payload":
        first_good_after = [i for i in range(bad.bad_chunks[0], bad.chunks) if i not in bad.bad_chunks]
        if first_good_after:
            return verdict("corrupt", f"{bad.reason}; chunk {first_good_after[0]} after it is intact, which a "
                                      f"write that did not finish cannot leave (a damaged, written frame)")
        if len(bad.bad_chunks) >= 2:
            return verdict("torn", f"{bad.reason}: the frame's last {len(bad.bad_chunks)} chunks are bad, "
                                   f"as a write that did not finish leaves them")
        if bad.frame_end is not None and _lost_pages(data, bad.offset, bad.frame_end):
            return verdict("torn", f"{bad.reason}: the frame ends in zeros from a page boundary on and only zeros "
                                   f"follow it, as a write into a preallocated segment that did not finish leaves it")
        return verdict("ambiguous", f"{bad.reason}: only the frame's last chunk is bad, which a torn write "
                                    f"and a flipped bit both leave")
    if bad.kind == "extension_consistent":
        return verdict("corrupt", f"{bad.reason}, while every chunk matches its checksum (a damaged, "
                                  f"written frame)")
    if bad.kind == "short_verified":
        return verdict("torn", bad.reason)
    if bad.kind == "short" and size < HEADER_SIZE:
        return verdict("torn", bad.reason)
    if zeros_from(data, bad.offset):  # a size update that reached the disk before the data did
        return verdict("torn", f"{bad.reason}: {size} zero bytes")
    return verdict("ambiguous", f"{bad.reason}: nothing proves whether it was acknowledged")


PAGE = 4096


def _lost_pages(data: memoryview, offset: int, end: int) -> bool:
    """The frame at ``offset`` ends in zeros that span a page boundary, and only zeros follow it: the pages
    of a write into a preallocated segment (`LogWriter`) that never reached the disk. (A flipped bit cannot
    zero a page; a frame's own bytes end in at most its 7 bytes of padding, or an IPC body's zero buffers.)"""
    boundary = (end - 1) // PAGE * PAGE
    return offset < boundary and zeros_from(data[:end], boundary) and zeros_from(data, end)


def zeros_from(data: memoryview, offset: int) -> bool:
    """Whether ``data`` holds only zero bytes from ``offset`` to its end (vectorised: a live segment's
    preallocated tail is a MiB of them)."""
    return not np.frombuffer(data, np.uint8, offset=min(offset, len(data))).any()


def _later_evidence(data: memoryview, start: int) -> tuple[int, int | None] | None:
    """The first intact frame at or after ``start`` and the highest watermark of the frames that follow it
    (None for a v0 frame, whose header says nothing about durability)."""
    position = start
    while True:
        position = _find(data, MAGIC, position)
        if position < 0:
            return None
        item = read_frame(data, position, verify=False)
        if isinstance(item, Frame) and (item.chunked or isinstance(read_frame(data, position), Frame)):
            if not item.chunked:
                return position, None
            best = item.watermark if item.watermark is not None else -1
            for later in scan(data, item.end, verify=False):
                if isinstance(later, Frame) and later.watermark is not None:
                    best = max(best, later.watermark)
            return position, best
        position += 1


def _count_frames(data: memoryview, offset: int) -> tuple[int, int]:
    """Frames (and their events) in the bytes from ``offset`` whose headers can be read."""
    frames = events = 0
    while offset < len(data):
        item = read_frame(data, offset, verify=False)
        if isinstance(item, Frame):
            frames, events, offset = frames + 1, events + item.count, item.end
            continue
        if item.kind in ("short_verified", "extension", "payload", "extension_consistent") and item.count:
            frames, events = frames + 1, events + item.count
        elif item.kind == "crc" or (item.kind == "short" and len(data) - offset >= HEADER_SIZE):
            frames += 1  # a v0 header: its count is not verified
            events += HEADER.unpack_from(data, offset)[6]
        if item.frame_end is None:
            break
        offset = item.frame_end
    return frames, events


def _find(data: memoryview, needle: bytes, start: int) -> int:
    # memoryview has no find(); bytes(data) would copy the whole segment, so search through the object
    # that owns the memory when it supports find (bytes, mmap), else fall back to a copy of the rest.
    owner = data.obj
    if hasattr(owner, "find") and data.nbytes == len(owner):
        return owner.find(needle, start)
    found = bytes(data[start:]).find(needle)
    return found if found < 0 else start + found
