"""Crash safety: torn tails are cut back with a warning, flipped bytes are reported, kill -9 loses nothing."""

import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.errors import LogCorruptionError
from gyre.log import LogReader, LogRecoveryWarning, LogWriter
from gyre.log.crash import run_crash_points
from gyre.log.frames import BadFrame, Frame, scan
from tests.conftest import run_events


def _frames(segment: Path) -> list[Frame]:
    return [f for f in scan(memoryview(segment.read_bytes())) if isinstance(f, Frame)]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A committed log with one segment of many frames (one commit per event)."""
    path = tmp_path_factory.mktemp("written") / "log"
    with LogWriter(path) as writer:
        for event in run_events(executions=3, calls=4):
            writer.append(event)
            writer.commit()
    return path


def _copy(source: Path, tmp_path: Path) -> tuple[Path, Path]:
    target = Path(tempfile.mkdtemp(dir=tmp_path)) / "copy"  # hypothesis reuses tmp_path across examples
    shutil.copytree(source, target)
    return target, next(target.glob("*.seg"))


@given(cut=st.floats(0.0, 0.999))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_torn_tail_is_cut_back_to_the_last_whole_frame(written: Path, tmp_path: Path, cut: float) -> None:
    path, segment = _copy(written, tmp_path)
    frames = _frames(segment)
    last = frames[-1]
    offset = last.offset + int(cut * (last.end - last.offset))  # crash while the last frame was written
    data = segment.read_bytes()
    segment.write_bytes(data[:offset])
    # Readers see the whole frames and nothing of the torn one, without modifying anything.
    assert LogReader(path).last_seq() == frames[-2].last_seq
    expected_drop = offset - last.offset
    if expected_drop:
        with pytest.warns(LogRecoveryWarning, match=f"torn tail of {expected_drop} bytes"):
            LogWriter(path).close()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", LogRecoveryWarning)
            LogWriter(path).close()
    assert segment.stat().st_size == last.offset
    assert [e.seq for e in LogReader(path).events()] == list(range(frames[-2].last_seq + 1))
    with LogWriter(path) as writer:  # and the log keeps going from there
        assert writer.next_seq == frames[-2].last_seq + 1


def test_garbage_after_the_last_frame_is_a_torn_tail(written: Path, tmp_path: Path) -> None:
    path, segment = _copy(written, tmp_path)
    size = segment.stat().st_size
    with open(segment, "ab") as f:
        f.write(b"\0" * 4096)  # a size update that reached disk before the data did
    with pytest.warns(LogRecoveryWarning, match="4096 bytes"):
        LogWriter(path).close()
    assert segment.stat().st_size == size


@given(position=st.floats(0.0, 1.0, exclude_max=True), bit=st.integers(0, 7))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_a_flipped_bit_is_reported_with_segment_and_offset(written: Path, tmp_path: Path, position: float,
                                                           bit: int) -> None:
    path, segment = _copy(written, tmp_path)
    original = list(LogReader(path).events())
    data = bytearray(segment.read_bytes())
    frames = _frames(segment)
    offset = int(position * len(data))
    data[offset] ^= 1 << bit
    segment.write_bytes(bytes(data))
    in_last_frame = offset >= frames[-1].offset
    if not in_last_frame:
        with pytest.raises(LogCorruptionError) as error:
            LogReader(path).verify()
        hit = next(f for f in frames if f.offset <= offset < f.end)
        assert error.value.segment == str(segment)
        assert error.value.offset == hit.offset  # the frame that holds the flipped byte
        assert f"at byte offset {hit.offset}" in str(error.value)
        with pytest.raises(LogCorruptionError):
            LogWriter(path)
    else:
        # Indistinguishable from a torn write of the last frame (as in Kafka and SQLite's WAL).
        assert LogReader(path).verify().torn_tail_bytes == len(data) - frames[-1].offset
    # Whatever a reader returns is exactly what was written: never a corrupted event.
    try:
        returned = list(LogReader(path).events())
    except LogCorruptionError:
        return
    assert [e.model_dump() for e in returned] == [e.model_dump() for e in original[: len(returned)]]


def test_every_frame_scan_stops_at_a_bad_frame(written: Path) -> None:
    segment = next(written.glob("*.seg"))
    items = list(scan(memoryview(segment.read_bytes()[:-3])))
    assert isinstance(items[-1], BadFrame) and "runs past the end" in items[-1].reason


def test_kill_minus_nine_at_200_points_loses_no_acknowledged_event(tmp_path: Path) -> None:
    report = run_crash_points(tmp_path, points=200, seed=20261129)
    assert report.points == 200
    assert report.failures == []
    assert report.lost == 0
    assert report.events_checked > 1000
