"""The sealer's re-batching: frames grouped by their kinds must read back in the segment's order, and the sealed
copy in (kind, seq) order, whatever mix of frame shapes the segment holds."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from gyre.events.schema import event_schema, evolve
from gyre.log import LogWriter
from gyre.log.seal import SEAL_ORDER, seal_segment, segment_table
from gyre.log.segment import SegmentData, list_segments
from tests.conftest import run_events


def _frame_by_frame(segment: Path) -> pa.Table:
    """The segment read one frame at a time (what re-batching must equal)."""
    data = SegmentData(segment)
    found = data.scan(verify=True)
    return pa.Table.from_batches([evolve(data.decode(f)) for f in data.batch_frames(found)], schema=event_schema())


def test_a_segment_of_mixed_frames_reads_in_seq_order_and_seals_in_kind_order(tmp_path: Path) -> None:
    events = run_events(executions=6, calls=4)
    with LogWriter(tmp_path / "log", seal=False) as writer:
        sizes = [1, 3, 2, 5, 1]  # frames of one event and of several kinds, interleaved
        at, i = 0, 0
        while at < len(events):
            writer.append(events[at:at + sizes[i % len(sizes)]])
            writer.commit()
            at, i = at + sizes[i % len(sizes)], i + 1
    ((_, segment),) = list_segments(tmp_path / "log")
    expected = _frame_by_frame(segment)
    data = SegmentData(segment)
    masks = [data.kinds_mask(f) for f in data.batch_frames(data.scan(verify=True))]
    assert len(set(masks)) > 2 and masks != sorted(masks)  # several frame shapes, interleaved
    table = segment_table(segment)
    assert table.column("seq").to_pylist() == list(range(len(events)))
    assert table.equals(expected)
    sealed = pq.read_table(seal_segment(segment), schema=event_schema())
    assert sealed.equals(expected.sort_by(list(SEAL_ORDER)))
