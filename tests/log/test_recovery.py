"""Crash safety: a torn tail is quarantined (never just deleted), damage the log can prove acknowledged is
an error that cuts nothing, what stays ambiguous is quarantined and reported, kill -9 loses nothing."""

import json
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.errors import LogCorruptionError
from gyre.events.models import ModelCallFinished
from gyre.events.schema import event_schema
from gyre.log import LogReader, LogRecoveryWarning, LogWriter
from gyre.log.crash import run_crash_points
from gyre.log.frames import CLOSE_FRAME, HEADER_SIZE, BadFrame, Frame, scan
from gyre.log.segment import quarantine_files, schema_frame, segment_name
from tests.conftest import run_events

HYPOTHESIS = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _frames(segment: Path) -> list[Frame]:
    return [f for f in scan(memoryview(segment.read_bytes())) if isinstance(f, Frame)]


def _big_call(i: int) -> ModelCallFinished:
    """A call whose frame spans several 64 KiB chunks (30,000 tokens: ~240 KB)."""
    return ModelCallFinished(execution_id="e0", call_id=f"c{i}", cell_id="cell0",
                             output_ids=[(i + t) % 1000 for t in range(30_000)], output_logprobs=[-0.5] * 30_000)


def _write(path: Path) -> None:
    with LogWriter(path) as writer:
        for event in run_events(executions=2, calls=2):  # small frames, one commit each
            writer.append(event)
            writer.commit()
        for i in range(3):  # multi-chunk frames
            writer.append(_big_call(i))
            writer.commit()


@pytest.fixture(scope="module")
def closed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log whose writer closed cleanly: its CLOSE marker vouches for every frame."""
    path = tmp_path_factory.mktemp("closed") / "log"
    _write(path)
    assert _frames(next(path.glob("*.seg")))[-1].frame_type == CLOSE_FRAME
    return path


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same log as a crashed writer leaves it: no CLOSE marker, so nothing vouches for the last frame."""
    path = tmp_path_factory.mktemp("crashed") / "log"
    _write(path)
    segment = next(path.glob("*.seg"))
    last = _frames(segment)[-1]
    segment.write_bytes(segment.read_bytes()[:last.offset])
    return path


def _copy(source: Path, tmp_path: Path) -> tuple[Path, Path]:
    target = Path(tempfile.mkdtemp(dir=tmp_path)) / "copy"  # hypothesis reuses tmp_path across examples
    shutil.copytree(source, target)
    return target, next(target.glob("*.seg"))


def _flip(segment: Path, offset: int, bit: int = 0) -> bytes:
    data = bytearray(segment.read_bytes())
    data[offset] ^= 1 << bit
    segment.write_bytes(bytes(data))
    return bytes(data)


def _open_quietly(path: Path) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", LogRecoveryWarning)
        LogWriter(path).close()
    return [str(w.message) for w in caught if issubclass(w.category, LogRecoveryWarning)]


@given(cut=st.floats(0.0, 0.999))
@HYPOTHESIS
def test_a_torn_write_is_cut_back_and_quarantined(crashed: Path, tmp_path: Path, cut: float) -> None:
    path, segment = _copy(crashed, tmp_path)
    frames = _frames(segment)
    last = frames[-1]
    offset = last.offset + int(cut * (last.end - last.offset))  # crash while the last frame was written
    data = segment.read_bytes()
    segment.write_bytes(data[:offset])
    torn = data[last.offset:offset]
    # Readers see the whole frames and nothing of the torn one, without modifying anything.
    assert LogReader(path).last_seq() == frames[-2].last_seq
    if torn:
        report = LogReader(path).verify()
        assert (report.tail_verdict, report.torn_tail_bytes, report.tail_offset) == ("torn", len(torn), last.offset)
        assert not report.ok and report.torn_tail_ok
        messages = _open_quietly(path)
        assert len(messages) == 1 and f"torn tail of {len(torn)} bytes" in messages[0]
        held = 1 if offset - last.offset >= HEADER_SIZE else 0  # a readable header says what it held
        assert f"{held} frame(s) holding {held * last.count} event(s)" in messages[0]
        (moved,) = quarantine_files(path)
        assert moved.read_bytes() == torn  # the bytes are kept, beside the segment
        note = json.loads(moved.with_name(moved.name + ".json").read_text())
        assert (note["segment"], note["offset"], note["verdict"]) == (segment.name, last.offset, "torn")
    else:
        assert _open_quietly(path) == []
    assert [e.seq for e in LogReader(path).events()] == list(range(frames[-2].last_seq + 1))
    with LogWriter(path) as writer:  # and the log keeps going from there
        assert writer.next_seq == frames[-2].last_seq + 1


def test_zeros_after_the_last_frame_are_its_end(crashed: Path, tmp_path: Path) -> None:
    """A live segment is preallocated (`LogWriter`'s ``preallocate_bytes``): zeros after its last frame are
    where the next frame goes, not damage. Nothing is quarantined, the writer continues over them, and a
    clean close cuts them."""
    path, segment = _copy(crashed, tmp_path)
    before = segment.read_bytes()
    with open(segment, "ab") as f:
        f.write(b"\0" * 4096)  # a crash with zeros ahead of the last frame (or a size that reached the disk first)
    assert LogReader(path).verify().tail_verdict is None
    assert _open_quietly(path) == []
    after = segment.read_bytes()  # the reopened writer's clean close marked the end, right after the frames
    assert after.startswith(before) and _frames(segment)[-1].frame_type == CLOSE_FRAME
    assert len(after) == len(before) + _frames(segment)[-1].end - _frames(segment)[-1].offset
    assert quarantine_files(path) == []


@given(position=st.floats(0.0, 1.0, exclude_max=True), bit=st.integers(0, 7))
@settings(max_examples=60, parent=HYPOTHESIS)
def test_a_flipped_bit_in_a_closed_log_is_an_error_that_cuts_nothing(closed: Path, tmp_path: Path,
                                                                     position: float, bit: int) -> None:
    path, segment = _copy(closed, tmp_path)
    frames = _frames(segment)
    original = [e.model_dump() for e in LogReader(path).events()]
    offset = int(position * segment.stat().st_size)
    damaged = _flip(segment, offset, bit)
    if offset >= frames[-1].offset:  # the CLOSE marker itself: it holds no event
        try:
            messages = _open_quietly(path)  # a damaged header: nothing proves what it was, quarantined
        except LogCorruptionError as error:  # a verified header over a damaged watermark: an error
            assert error.offset == frames[-1].offset and segment.read_bytes() == damaged
            return
        assert len(messages) == 1 and "0 event(s)" in messages[0]
        assert [e.model_dump() for e in LogReader(path).events()] == original
        return
    hit = next(f for f in frames if f.offset <= offset < f.end)
    for attempt in (lambda: LogReader(path).verify(), lambda: LogWriter(path), lambda: list(LogReader(path).events())):
        with pytest.raises(LogCorruptionError) as error:
            attempt()
        assert error.value.segment == str(segment)
        assert error.value.offset == hit.offset  # the frame that holds the flipped byte
    assert segment.read_bytes() == damaged and not quarantine_files(path)  # nothing cut, nothing moved


def test_a_flipped_bit_in_the_last_acknowledged_frame_of_a_crashed_log(crashed: Path, tmp_path: Path) -> None:
    """Without a CLOSE marker, chunk checksums still tell a flipped bit (one bad chunk between good ones:
    an error) from what a torn write leaves; a bad last chunk stays ambiguous: quarantined and reported."""
    path, segment = _copy(crashed, tmp_path)
    last = _frames(segment)[-1]
    assert len(last.chunk_crcs) // 4 > 2
    before = segment.read_bytes()
    damaged = _flip(segment, last.end - len(last.payload) + 100)  # chunk 0 of the last frame
    with pytest.raises(LogCorruptionError, match="chunk 1 after it is intact") as error:
        LogWriter(path)
    assert error.value.offset == last.offset and segment.read_bytes() == damaged
    with pytest.raises(LogCorruptionError):
        LogReader(path).verify()

    segment.write_bytes(before)
    damaged = _flip(segment, last.end - 10)  # the last chunk: a torn write could leave that too
    report = LogReader(path).verify()
    assert report.tail_verdict == "ambiguous" and not report.torn_tail_ok
    messages = _open_quietly(path)
    assert len(messages) == 1 and "Nothing proves whether they were acknowledged" in messages[0]
    assert "1 frame(s) holding 1 event(s)" in messages[0]
    assert quarantine_files(path)[0].read_bytes() == damaged[last.offset:]
    assert segment.read_bytes()[:last.offset] == damaged[:last.offset]
    assert LogReader(path).last_seq() == last.first_seq - 1


def test_a_later_frame_vouches_for_an_earlier_one(crashed: Path, tmp_path: Path) -> None:
    """A frame written after seq N was durable proves every frame up to N acknowledged: a bad frame it
    follows is corruption even where the damage would look like a torn write (a bad suffix of chunks)."""
    path, segment = _copy(crashed, tmp_path)
    frames = _frames(segment)
    victim, follower = frames[-2], frames[-1]
    assert follower.watermark >= victim.last_seq  # one commit per frame: each was durable before the next
    data = bytearray(segment.read_bytes())
    start = victim.end - len(victim.payload)
    chunk = 1 << victim.chunk_shift
    data[start + chunk:victim.end] = bytes(victim.end - start - chunk)  # every chunk after the first
    segment.write_bytes(bytes(data))
    with pytest.raises(LogCorruptionError, match="was written after seq") as error:
        LogWriter(path)
    assert error.value.offset == victim.offset


def test_a_schema_frame_never_completed_is_quarantined_not_deleted(closed: Path, tmp_path: Path) -> None:
    path, _ = _copy(closed, tmp_path)
    next_seq = LogReader(path).last_seq() + 1
    newest = path / segment_name(next_seq)
    newest.write_bytes(schema_frame(event_schema(), next_seq)[:20])  # the crash came while creating it
    messages = _open_quietly(path)
    assert len(messages) == 1 and "torn tail of 20 bytes" in messages[0]
    assert not newest.exists() and quarantine_files(path)[0].name.startswith(newest.name)
    assert LogReader(path).last_seq() == next_seq - 1


def test_every_frame_scan_stops_at_a_bad_frame(closed: Path) -> None:
    segment = next(closed.glob("*.seg"))
    items = list(scan(memoryview(segment.read_bytes()[:-3])))
    assert isinstance(items[-1], BadFrame) and "runs past the end" in items[-1].reason


def test_kill_minus_nine_at_200_points_loses_no_acknowledged_event(tmp_path: Path) -> None:
    report = run_crash_points(tmp_path, points=200, seed=20261129)
    assert report.points == 200
    assert report.failures == []
    assert report.lost == 0
    assert report.events_checked > 1000
