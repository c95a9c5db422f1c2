"""The live segment is preallocated (zeros written ahead of its last frame, so a commit's fdatasync changes no
file size): the zeros read as the log's end everywhere, a crash with zeros ahead recovers without a warning,
a torn write into them is still cut back, and no segment but the live one keeps them."""

import shutil
import tempfile
import threading
import warnings
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.log import LogReader, LogRecoveryWarning, LogWriter
from gyre.log.frames import CLOSE_FRAME, Frame, scan
from gyre.log.segment import list_segments, quarantine_files
from tests.conftest import run_events

HYPOTHESIS = settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _frames(segment: Path) -> list[Frame]:
    return [f for f in scan(memoryview(segment.read_bytes())) if isinstance(f, Frame)]


def _crash_image(path: Path, tmp_path: Path) -> Path:
    """The log directory as a crash of its (still open) writer leaves it: the files as they are now."""
    target = Path(tempfile.mkdtemp(dir=tmp_path)) / "crashed"  # hypothesis reuses tmp_path across examples
    shutil.copytree(path, target, ignore=shutil.ignore_patterns("LOCK"))
    return target


def _reopen(path: Path) -> tuple[int, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LogRecoveryWarning)
        with LogWriter(path) as writer:
            next_seq = writer.next_seq
    return next_seq, [str(w.message) for w in caught if issubclass(w.category, LogRecoveryWarning)]


def test_the_live_segment_keeps_zeros_ahead_and_a_clean_close_cuts_them(tmp_path: Path) -> None:
    events = run_events()
    with LogWriter(tmp_path / "log", preallocate_bytes=8192) as writer:
        segment = writer._segment
        sizes = []
        for event in events:
            writer.append(event)
            writer.commit()
            sizes.append(segment.stat().st_size)
            assert sizes[-1] >= writer._offset  # zeros lie ahead of the last frame (or end right there)
        assert len(set(sizes)) < len(sizes) // 2  # most commits did not change the file's size
        assert [e.seq for e in LogReader(tmp_path / "log").events()] == list(range(len(events)))
    frames = _frames(segment)
    assert frames[-1].frame_type == CLOSE_FRAME and segment.stat().st_size == frames[-1].end


def test_a_rotation_cuts_the_full_segments_zeros(tmp_path: Path) -> None:
    with LogWriter(tmp_path / "log", segment_bytes=4096, preallocate_bytes=16384) as writer:
        for event in run_events(executions=8):
            writer.append(event)
            writer.commit()
        segments = list_segments(tmp_path / "log")
        assert len(segments) > 2
        for _, older in segments[:-1]:  # whole frames to the last byte: nothing for a reader to skip
            assert older.stat().st_size == _frames(older)[-1].end
        assert segments[-1][1].stat().st_size > writer._offset
        assert LogReader(tmp_path / "log").verify().ok


def _crashed_after(events: list, tmp_path: Path, preallocate: int) -> Path:
    """A log that committed ``events`` one by one, as a crash would leave it on disk (the writer still open)."""
    path = Path(tempfile.mkdtemp(dir=tmp_path)) / "log"
    writer = LogWriter(path, preallocate_bytes=preallocate)
    try:
        for event in events:
            writer.append(event)
            writer.commit()
        return _crash_image(path, tmp_path)
    finally:
        writer.close()


@given(commits=st.integers(1, 40), preallocate=st.sampled_from([0, 64, 1000, 4096, 1 << 20]))
@HYPOTHESIS
def test_a_crash_with_zeros_ahead_recovers_everything_without_a_warning(tmp_path: Path, commits: int,
                                                                      preallocate: int) -> None:
    events = run_events(executions=4, calls=4)[:commits]
    crashed = _crashed_after(events, tmp_path, preallocate)
    reader = LogReader(crashed)
    assert [e.seq for e in reader.events()] == list(range(len(events)))
    report = reader.verify()
    assert report.tail_verdict is None and report.ok
    next_seq, messages = _reopen(crashed)
    assert (next_seq, messages, quarantine_files(crashed)) == (len(events), [], [])
    with LogWriter(crashed) as writer:  # and the log keeps going over the zeros
        writer.append(events[0])
        writer.commit()
    assert [e.seq for e in LogReader(crashed).events()] == list(range(len(events) + 1))


@given(cut=st.floats(0.0, 0.999))
@HYPOTHESIS
def test_a_torn_write_into_the_zeros_is_cut_back(tmp_path: Path, cut: float) -> None:
    """A crash while the last frame was written: its bytes from some point on never reached the disk, which
    then holds the preallocated zeros there. The frames before it stay; the torn one is moved aside."""
    events = run_events(executions=2, calls=2)
    crashed = _crashed_after(events, tmp_path, 1 << 16)
    (_, segment), = list_segments(crashed)
    frames = _frames(segment)
    last = frames[-1]
    data = bytearray(segment.read_bytes())
    at = last.offset + int(cut * (last.end - last.offset))
    if not any(data[at:last.end]):  # only the frame's zero padding: nothing was lost, the frame is whole
        assert [e.seq for e in LogReader(crashed).events()] == list(range(len(events)))
        return
    data[at:last.end] = bytes(last.end - at)
    segment.write_bytes(bytes(data))
    assert [e.seq for e in LogReader(crashed).events()] == list(range(frames[-2].last_seq + 1))
    next_seq, messages = _reopen(crashed)
    assert next_seq == frames[-2].last_seq + 1
    if at == last.offset:  # nothing of it reached the disk: zeros, the end
        assert messages == [] and quarantine_files(crashed) == []
    else:
        assert len(messages) == 1 and len(quarantine_files(crashed)) == 1
        if (last.end - 1) // 4096 * 4096 >= max(at, last.offset + 1):  # a whole page of it lost: provably torn
            assert "torn tail" in messages[0]
        assert quarantine_files(crashed)[0].read_bytes()[: at - last.offset] == bytes(data[last.offset:at])


def test_follow_reads_across_rotations_of_preallocated_segments(tmp_path: Path) -> None:
    events = run_events(executions=6)
    path = tmp_path / "log"
    with LogWriter(path, segment_bytes=2048, preallocate_bytes=4096) as writer:
        writer.append(events[0])
        writer.commit()
        seen: list[int] = []
        done = threading.Event()

        def follow() -> None:
            for batch in LogReader(path).follow(stop=done.is_set, poll_s=0.001):
                seen.extend(batch.column("seq").to_pylist())
                if len(seen) >= len(events):
                    done.set()

        follower = threading.Thread(target=follow)
        follower.start()
        for event in events[1:]:
            writer.append(event)
            writer.commit()
        assert done.wait(30)
        follower.join(5)
    assert seen == list(range(len(events))) and len(list_segments(path)) > 2
