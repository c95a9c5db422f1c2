"""The on-disk format of a process's spill (`gyre.cluster.spill`), and reading one without holding it.

A spill directory holds segment files ``<first record id>.spill`` of frames

    magic (4 bytes) | record id (u64) | payload length (u64) | crc32 of id, length and payload (u32) | payload

whose payload is the record's events in the wire's Arrow IPC encoding (`gyre.events.wire`). The format
lives here, below the cluster that writes it, so that the audit of a finished run (`gyre.audit`) can count
the events left in spills without importing the control plane.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

from gyre.events.models import Event
from gyre.events.wire import pack_events, unpack_events

log = logging.getLogger(__name__)

MAGIC = b"GSP1"
SUFFIX = ".spill"
_HEADER = struct.Struct("<4sQQI")
_CHECKED = struct.Struct("<QQ")  # the header fields the checksum covers with the payload


def spill_frame(record_id: int, events: Sequence[Event]) -> bytes:
    """One frame holding ``events`` as record ``record_id``."""
    payload = pack_events(events)
    length = len(payload)
    crc = zlib.crc32(payload, zlib.crc32(_CHECKED.pack(record_id, length)))
    return _HEADER.pack(MAGIC, record_id, length, crc) + payload


def spill_frames(data: bytes, path: Path) -> list[tuple[int, int, int]]:
    """The valid frames of a segment: (record id, payload start, end); stops at the first bad one."""
    frames = []
    offset = 0
    previous = -1
    while offset < len(data):
        bad = _bad_frame(data, offset, previous)
        if bad:
            log.warning("spill segment %s ends at byte %d of %d: %s (a write cut short by a kill); "
                        "the rest is ignored", path, offset, len(data), bad)
            break
        _, record_id, length, _ = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        frames.append((record_id, start, start + length))
        offset = start + length
        previous = record_id
    return frames


def spilled_stamps(path: str | Path) -> list[tuple[str, int]]:
    """The (producer, producer_seq) of every event in one segment file's valid frames, read without taking
    the spill's lock (an audit of a finished run: a stamp the log holds was handed over, one it lacks is lost)."""
    path = Path(path)
    data = path.read_bytes()
    stamps: list[tuple[str, int]] = []
    for _, start, end in spill_frames(data, path):
        stamps += [(e.producer or "", e.producer_seq if e.producer_seq is not None else -1)
                   for e in unpack_events(data[start:end])]
    return stamps


def _bad_frame(data: bytes, offset: int, previous: int) -> str:
    if len(data) - offset < _HEADER.size:
        return "a torn frame header"
    magic, record_id, length, crc = _HEADER.unpack_from(data, offset)
    if magic != MAGIC:
        return "no frame magic"
    start = offset + _HEADER.size
    if len(data) - start < length:
        return f"a torn frame ({len(data) - start} of {length} payload bytes)"
    if zlib.crc32(data[start:start + length], zlib.crc32(_CHECKED.pack(record_id, length))) != crc:
        return "a frame whose checksum does not match"
    if record_id <= previous:
        return f"record id {record_id} after {previous}"
    return ""
