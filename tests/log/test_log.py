"""The writer and reader: gapless seqs, ranges, kinds, rotation, one writer, bad input refused."""

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from gyre.errors import EventValidationError, LogClosedError, LogError, LogLockedError, UnknownEventKindError
from gyre.events import encode
from gyre.events.models import MicroStepClaimed, RewardRecorded
from gyre.log import LogReader, LogWriter
from tests.conftest import run_events


def test_append_commit_read_back(log_dir: Path) -> None:
    events = run_events()
    with LogWriter(log_dir, run_id="r1") as writer:
        first = writer.append(events[:5])
        second = writer.append(events[5:])
        assert (first.first, first.last, second.first) == (0, 4, 5)
        assert writer.durable_seq == -1
        assert writer.commit() == len(events) - 1
    reader = LogReader(log_dir)
    back = list(reader.events())
    assert [e.seq for e in back] == list(range(len(events)))
    assert all(e.run_id == "r1" for e in back)
    assert [e.model_dump(exclude={"seq", "ts", "run_id"}) for e in back] == [
        e.model_dump(exclude={"seq", "ts", "run_id"}) for e in events]


def test_ranges_and_kinds(log_dir: Path) -> None:
    events = run_events(executions=6)
    with LogWriter(log_dir, segment_bytes=4096) as writer:
        for event in events:  # many small commits: many frames and segments
            writer.append(event)
            writer.commit()
    reader = LogReader(log_dir)
    assert len(reader.segments()) > 3
    seqs = [s for b in reader.read(from_seq=10, to_seq=20) for s in b.column("seq").to_pylist()]
    assert seqs == list(range(10, 21))
    rewards = [e for e in reader.events(kinds=["reward_recorded"])]
    assert [e.execution_id for e in rewards] == [f"e{i}" for i in range(6)]
    assert all(b.schema == reader.table().schema for b in reader.read())  # full schema, always
    with pytest.raises(UnknownEventKindError, match="unknown event kind"):
        list(reader.read(kinds=["rewards"]))


def test_reopen_continues_the_sequence(log_dir: Path) -> None:
    with LogWriter(log_dir) as writer:
        writer.append(run_events(executions=1))
    with LogWriter(log_dir) as writer:
        start = writer.next_seq
        writer.append(RewardRecorded(execution_id="late", reward=1.0))
    assert LogReader(log_dir).last_seq() == start
    assert [e.seq for e in LogReader(log_dir).events()] == list(range(start + 1))


def test_second_writer_gets_a_clear_error(log_dir: Path) -> None:
    with LogWriter(log_dir):
        with pytest.raises(LogLockedError, match="already open for writing"):
            LogWriter(log_dir)
        code = ("import sys; from gyre.log import LogWriter\n"
                "try:\n    LogWriter(sys.argv[1])\nexcept Exception as e:\n    print(type(e).__name__, e)")
        out = subprocess.run([sys.executable, "-c", code, str(log_dir)], capture_output=True, text=True,
                             check=True).stdout
        assert out.startswith("LogLockedError")
    LogWriter(log_dir).close()  # released on close


def test_bad_input_is_refused_and_nothing_written_is_touched(log_dir: Path) -> None:
    with LogWriter(log_dir) as writer:
        writer.append(run_events(executions=1))
        writer.commit()
        before = LogReader(log_dir).table()
        with pytest.raises(EventValidationError, match="item 1 is a dict"):
            writer.append([RewardRecorded(execution_id="e", reward=0.1), {"kind": "reward_recorded"}])
        bad = pa.RecordBatch.from_pydict({"kind": ["reward_recorded"], "execution_id": [None],
                                          "reward_recorded": pa.array([{"reward": 0.5}])})
        with pytest.raises(EventValidationError, match="execution_id"):
            writer.append_batch(bad)
        assert writer.next_seq == before.num_rows  # refused input consumed no seq
        writer.append(RewardRecorded(execution_id="ok", reward=0.5))
    after = LogReader(log_dir).table()
    assert after.slice(0, before.num_rows).equals(before)
    assert after.num_rows == before.num_rows + 1


def test_columnar_append_batch(log_dir: Path) -> None:
    rows = 10_000
    batch = encode([MicroStepClaimed(step=2, cell_id="c", micro_step=i % 8) for i in range(rows)], 0)
    with LogWriter(log_dir, run_id="run") as writer:
        writer.append(RewardRecorded(execution_id="e", reward=0.5))
        got = writer.append_batch(batch.drop_columns(["seq", "ts"]))
        assert (got.first, got.last) == (1, rows)
        writer.append(RewardRecorded(execution_id="e", reward=0.25))
    table = LogReader(log_dir).table()
    assert table.column("seq").to_pylist() == list(range(rows + 2))
    assert set(table.column("run_id").to_pylist()) == {"run"}
    assert table.column("kind").to_pylist()[1:3] == ["micro_step_claimed"] * 2


def test_append_batch_keeps_the_producers_time_and_stamps_only_the_rest(log_dir: Path) -> None:
    """A remote producer's event keeps its own ``ts`` through the columnar path, as through ``append``."""
    own = datetime(2026, 3, 1, 12, 0, 0, 123_456, tzinfo=UTC)
    events = [RewardRecorded(execution_id="a", reward=0.5, ts=own), RewardRecorded(execution_id="b", reward=0.5)]
    batch = encode(events, 0).drop_columns(["seq"])
    ts = batch.schema.get_field_index("ts")
    mixed = batch.set_column(ts, "ts", pa.array([own, None], batch.schema.field("ts").type))
    before = datetime.now(UTC)
    with LogWriter(log_dir) as writer:
        writer.append_batch(mixed)
        writer.append_batch(batch)
    stored = LogReader(log_dir).table().column("ts").to_pylist()
    assert stored[0] == own and stored[1] >= before
    assert stored[2:] == batch.column("ts").to_pylist()


def test_closed_writer_refuses_appends(log_dir: Path) -> None:
    writer = LogWriter(log_dir)
    writer.close()
    with pytest.raises(LogClosedError):
        writer.append(RewardRecorded(execution_id="e", reward=0.5))


def test_reader_of_a_missing_log_says_so(tmp_path: Path) -> None:
    with pytest.raises(LogError, match="no log at"):
        LogReader(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LogError, match="no segment files"):
        LogReader(tmp_path / "empty")


def test_an_empty_batch_takes_no_seq_and_writes_no_frame(log_dir: Path) -> None:
    empty = encode([RewardRecorded(execution_id="e", reward=0.5)], 0).drop_columns(["seq", "ts"]).slice(0, 0)
    with LogWriter(log_dir) as writer:
        got = writer.append_batch(empty)
        assert (got.first, got.last) == (0, -1)
        writer.append(RewardRecorded(execution_id="e", reward=0.5))
    reader = LogReader(log_dir)
    assert [b.num_rows for b in reader.read(batch_rows=0)] == [1]  # one frame: the empty batch made none
    assert reader.verify().ok
