"""Readers: follow() from another process, DuckDB views with pushdown, and logs of an older schema."""

import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pytest

from gyre.events import EVENT_TYPES
from gyre.log import LogReader, LogWriter
from gyre.log.seal import usable_sealed_copy
from gyre.log.segment import sealed_copies
from gyre.state import ExecutionsView, replay
from tests.conftest import run_events

FIXTURE_V0 = Path(__file__).resolve().parents[1] / "fixtures" / "log-v0"

WRITER = textwrap.dedent("""
    import sys, time
    from gyre.events.models import RewardRecorded
    from gyre.log import LogWriter
    with LogWriter(sys.argv[1], segment_bytes=8192) as writer:
        for i in range(int(sys.argv[2])):
            writer.append(RewardRecorded(execution_id=f"e{i}", reward=0.5))
            if i % 7 == 6:
                writer.commit()
                time.sleep(0.005)
""")


def test_follow_sees_what_another_process_commits(log_dir: Path) -> None:
    LogWriter(log_dir).close()  # the log exists before the follower starts
    n = 300
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(log_dir), str(n)])
    seen: list[int] = []
    deadline = time.monotonic() + 60
    try:
        for batch in LogReader(log_dir).follow(poll_s=0.005, stop=lambda: len(seen) >= n or
                                               time.monotonic() > deadline):
            seen.extend(batch.column("seq").to_pylist())
    finally:
        writer.wait(timeout=60)
    assert seen == list(range(n))
    assert len(LogReader(log_dir).segments()) > 1  # it followed across rotations


def test_follow_from_the_middle_with_kinds_and_idle_timeout(log_dir: Path) -> None:
    events = run_events(executions=5)
    with LogWriter(log_dir, segment_bytes=4096) as writer:
        for event in events:
            writer.append(event)
            writer.commit()
    batches = list(LogReader(log_dir).follow(from_seq=20, kinds=["reward_recorded"], idle_timeout_s=0.2))
    rows = pa.Table.from_batches(batches)
    assert set(rows.column("kind").to_pylist()) == {"reward_recorded"}
    assert min(rows.column("seq").to_pylist()) >= 20
    expected = [i for i, e in enumerate(events) if e.kind == "reward_recorded" and i >= 20]
    assert rows.column("seq").to_pylist() == expected


@pytest.fixture(scope="module")
def sealed_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sealed") / "log"
    with LogWriter(path, segment_bytes=16_384) as writer:
        for event in run_events(executions=12, calls=5):
            writer.append(event)
            writer.commit()
    return path


def test_duckdb_views_answer_like_the_reader(sealed_log: Path) -> None:
    reader = LogReader(sealed_log)
    segments = reader.segments()
    assert len(segments) > 2
    assert all(usable_sealed_copy(p) is not None for _, p in segments[:-1])  # sealed as Parquet
    con = reader.duckdb()
    views = {row[0] for row in con.execute("select view_name from duckdb_views() where not internal").fetchall()}
    assert {"events"} | {model.view for model in EVENT_TYPES.values()} <= views
    assert con.execute("select count(*) from events").fetchone()[0] == reader.last_seq() + 1
    calls = con.execute("select call_id, output_ids, prefix_len from model_calls order by seq").fetchall()
    expected = [(e.call_id, e.output_ids, e.prefix_len) for e in reader.events(kinds=["model_call_finished"])]
    assert calls == expected
    rewards = con.execute("select execution_id, reward from rewards order by seq").fetchall()
    assert rewards == [(f"e{i}", i / 12) for i in range(12)]


def test_duckdb_pushes_filters_into_both_scans(sealed_log: Path) -> None:
    con = LogReader(sealed_log).duckdb()
    plan = "\n".join(row[1] for row in con.execute(
        "explain select count(*) from model_calls where seq between 10 and 40").fetchall())
    assert "READ_PARQUET" in plan and "PYTHON_ARROW_SCAN" in plan
    parquet_part = plan[plan.index("READ_PARQUET"):]
    assert "Filters:" in parquet_part and "kind=" in parquet_part.replace(" ", "")
    assert "seq" in parquet_part[parquet_part.index("Filters:"):]


def test_a_damaged_sealed_copy_is_never_used(sealed_log: Path, tmp_path: Path) -> None:
    path = tmp_path / "log"
    shutil.copytree(sealed_log, path)
    segment = LogReader(path).segments()[0][1]
    (copy,) = sealed_copies(segment)
    data = bytearray(copy.read_bytes())
    data[len(data) // 2] ^= 0xFF
    copy.write_bytes(bytes(data))
    assert usable_sealed_copy(segment) is None
    expected = LogReader(sealed_log).duckdb().execute("select list(reward order by seq) from rewards").fetchone()
    assert LogReader(path).duckdb().execute("select list(reward order by seq) from rewards").fetchone() == expected
    report = LogReader(path).verify()
    assert not report.ok and "sealed copy is damaged" in report.problems[0]


def test_a_log_written_with_the_older_schema_stays_readable(tmp_path: Path) -> None:
    path = tmp_path / "old"
    shutil.copytree(FIXTURE_V0, path)
    reader = LogReader(path)
    reader.verify()
    events = list(reader.events())
    assert [e.kind for e in events][-3:] == ["model_call_finished", "execution_finished", "reward_recorded"]
    call = events[4]
    assert call.output_ids == [4, 5] and call.drift_tokens == 0 and call.cached_tokens == 0  # defaults
    assert events[-1].partial is False
    state, _ = replay(ExecutionsView(), path)
    assert state.executions["e0"].reward == 0.75 and state.executions["e0"].output_tokens == 2
    # A current writer continues the old log in a new segment; old and new read together.
    with LogWriter(path, segment_bytes=1 << 20) as writer:
        writer.append(run_events(executions=1))
    reader = LogReader(path)
    assert len(reader.segments()) == 2
    assert [e.seq for e in reader.events()] == list(range(reader.last_seq() + 1))
    con = reader.duckdb()
    assert con.execute("select count(*) from model_calls").fetchone()[0] == 1 + 3
    assert con.execute("select max(reward) from rewards").fetchone()[0] == 0.75


def test_small_frames_are_merged_into_batches_in_seq_order(tmp_path: Path, monkeypatch) -> None:
    """A log committed event by event (frames of one kind each) reads as few batches, same rows as frame
    by frame, in seq order, with ranges and kind filters applied."""
    events = run_events(executions=6, calls=4)
    with LogWriter(tmp_path / "log", segment_bytes=16 << 10) as writer:  # several segments
        for event in events:
            writer.append(event)
            writer.commit()
    reader = LogReader(tmp_path / "log")
    per_frame = list(reader.read(batch_rows=0))
    merged = list(reader.read())
    assert len(per_frame) == len(events) and len(merged) == len(reader.segments()) < len(per_frame)
    assert pa.Table.from_batches(merged).equals(pa.Table.from_batches(per_frame))

    sparse = list(reader.read(full_schema=False))
    assert all(b.column("seq").to_pylist() == sorted(b.column("seq").to_pylist()) for b in sparse)
    names = [f.name for f in sparse[0].schema]
    assert names == [n for n in pa.Table.from_batches(per_frame).schema.names if n in names]  # schema order

    ranged = pa.Table.from_batches(list(reader.read(from_seq=10, to_seq=60, kinds=["model_call_finished"])))
    table = pa.Table.from_batches(per_frame)
    seqs = table.column("seq").to_pylist()
    kinds = table.column("kind").to_pylist()
    assert ranged.column("seq").to_pylist() == [s for s, k in zip(seqs, kinds, strict=True)
                                                if 10 <= s <= 60 and k == "model_call_finished"]

    monkeypatch.setattr("gyre.log.reader.MERGE_BYTES", 1)  # a byte bound below one frame: no merging
    assert len(list(reader.read())) == len(events)
