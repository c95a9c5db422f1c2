"""Sealing: a rotated segment is rewritten as Parquet so DuckDB scans it natively with pushdown.

Rows are sorted by ``(kind, seq)`` so that every row group holds few kinds and its min/max statistics let
a per-kind view skip the rest. The framed segment remains the source of truth; a sealed file whose
schema is not the current one is ignored by readers (they decode the frames instead).
"""

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from gyre.events.schema import event_schema, evolve
from gyre.log.segment import SegmentData, fsync_dir, sealed_path

ROW_GROUP_ROWS = 32_768


def segment_table(segment: Path, tail_ok: bool = False) -> pa.Table:
    """All events of one segment as a full-schema table (checksums verified)."""
    data = SegmentData(segment)
    found = data.scan(verify=True, tail_ok=tail_ok)
    batches = [evolve(data.decode(frame)) for frame in data.batch_frames(found)]
    return pa.Table.from_batches(batches, schema=event_schema())


def seal_segment(segment: Path) -> Path:
    """Write ``segment``'s Parquet copy atomically (tmp file, fsync, rename, fsync dir)."""
    table = segment_table(segment).sort_by([("kind", "ascending"), ("seq", "ascending")])
    target = sealed_path(segment)
    tmp = target.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS, write_page_checksum=True)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_dir(segment.parent)
    return target


def sealed_is_current(segment: Path) -> bool:
    """A sealed copy exists and was written with the current schema."""
    path = sealed_path(segment)
    if not path.exists():
        return False
    try:
        return pq.read_schema(path).equals(event_schema(), check_metadata=False)
    except (pa.ArrowInvalid, OSError):
        return False
