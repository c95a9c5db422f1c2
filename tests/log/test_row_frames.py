"""Rows frames (#33): a small run of events is framed as its rows in JSON, which readers turn into exactly
the batch an Arrow frame of the same events holds; logs of Arrow frames (every log before) still read."""

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from gyre.errors import LogCorruptionError
from gyre.events.models import (
    Event,
    ModelCallFinished,
    ModelCallStarted,
    Redirect,
    RoleSwitchRequested,
)
from gyre.events.schema import evolve
from gyre.log import LogReader, LogWriter, frames
from gyre.log import segment as segment_module
from gyre.log.seal import segment_table
from gyre.log.segment import SegmentData, list_segments
from tests.conftest import run_events

T0 = datetime(2026, 12, 4, 16, 0, tzinfo=UTC)


def _timed(events: list[Event]) -> list[Event]:
    """The events with a time of their own, so that two logs of them hold the same bytes' worth of values."""
    return [e.model_copy(update={"ts": T0 + timedelta(microseconds=i)}) for i, e in enumerate(events)]


def _write(path: Path, events: list[Event], *, row_frames: bool, per_commit: int = 2) -> None:
    with LogWriter(path, run_id="r", row_frames=row_frames) as writer:
        for start in range(0, len(events), per_commit):
            writer.append(events[start:start + per_commit])
            writer.commit()


def _bodies(path: Path) -> list[bytes]:
    """The first byte of each batch frame's body: ``[`` for JSON rows, 0xFF for an Arrow IPC message."""
    out = []
    for _, segment in list_segments(path):
        data = SegmentData(segment)
        for frame in data.batch_frames(data.scan()):
            mask = data.kinds_mask(frame)
            start = 2 + len(mask) + (8 - (2 + len(mask)) % 8) % 8  # the mask, padded to 8 bytes
            out.append(bytes(frame.payload[start:start + 1]))
    return out


@pytest.mark.parametrize("per_commit", [1, 2, 5])  # (frames of alternating kinds: converted a kind at a time)
def test_a_small_commit_is_framed_as_rows_and_reads_back_as_its_arrow_frame_did(tmp_path: Path,
                                                                                 per_commit: int) -> None:
    events = _timed(run_events(executions=3, calls=3))
    _write(tmp_path / "rows", events, row_frames=True, per_commit=per_commit)
    _write(tmp_path / "arrow", events, row_frames=False, per_commit=per_commit)
    assert set(_bodies(tmp_path / "rows")) == {b"["}
    assert set(_bodies(tmp_path / "arrow")) == {b"\xff"}
    rows, arrow = LogReader(tmp_path / "rows"), LogReader(tmp_path / "arrow")
    for got, want in zip(rows.read(), arrow.read(), strict=True):
        assert got.equals(want) and got.schema.equals(want.schema, check_metadata=True)
    assert rows.table().equals(arrow.table())
    assert list(rows.events()) == list(arrow.events())
    for kind in ("model_call_finished", "reward_recorded"):
        assert list(rows.events(kinds=[kind])) == list(arrow.events(kinds=[kind]))
    followed = pa.Table.from_batches([evolve(b) for b in rows.follow(idle_timeout_s=0.0)])
    assert followed.equals(arrow.table())
    assert segment_table(list_segments(tmp_path / "rows")[0][1]).equals(
        segment_table(list_segments(tmp_path / "arrow")[0][1]))


def _flagged(path: Path) -> list[bool]:
    out = []
    for _, seg in list_segments(path):
        data = SegmentData(seg)
        out += [frame.rows for frame in data.batch_frames(data.scan())]
    return out


def test_a_reader_from_before_rows_frames_refuses_the_log_as_a_newer_gyres(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    events = _timed(run_events(executions=2, calls=2))
    _write(tmp_path / "rows", events, row_frames=True)
    _write(tmp_path / "arrow", events, row_frames=False)
    assert set(_flagged(tmp_path / "rows")) == {True} and set(_flagged(tmp_path / "arrow")) == {False}
    monkeypatch.setattr(frames, "KNOWN_FLAGS", frames.FLAG_CHUNKED)  # the flags a Gyre from before knows
    with pytest.raises(LogCorruptionError, match="a newer Gyre wrote this log"):
        list(LogReader(tmp_path / "rows").read())
    with pytest.raises(LogCorruptionError, match="a newer Gyre wrote this log"):
        LogWriter(tmp_path / "rows").close()  # nor does its writer append to it (nothing is quarantined)
    assert not list((tmp_path / "rows").glob("*.quarantine"))
    assert sum(b.num_rows for b in LogReader(tmp_path / "arrow").read()) == len(events)  # Arrow frames: as ever


def test_rows_frames_written_before_their_flag_still_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = _timed(run_events(executions=2, calls=2))
    with monkeypatch.context() as patch:
        patch.setattr(segment_module, "FLAG_ROWS", 0)  # as the writer framed them between #33's rows and the flag
        _write(tmp_path / "unflagged", events, row_frames=True)
    _write(tmp_path / "arrow", events, row_frames=False)
    assert set(_flagged(tmp_path / "unflagged")) == {False} and set(_bodies(tmp_path / "unflagged")) == {b"["}
    for got, want in zip(LogReader(tmp_path / "unflagged").read(), LogReader(tmp_path / "arrow").read(),
                         strict=True):
        assert got.equals(want)


def test_a_log_of_arrow_frames_goes_on_with_rows_frames_and_reads_in_order(tmp_path: Path) -> None:
    events = _timed(run_events(executions=4, calls=2))
    half = len(events) // 2
    _write(tmp_path / "log", events[:half], row_frames=False)  # a log written before #33
    _write(tmp_path / "log", events[half:], row_frames=True)
    assert b"\xff" in _bodies(tmp_path / "log") and b"[" in _bodies(tmp_path / "log")
    _write(tmp_path / "arrow", events, row_frames=False)
    assert list(LogReader(tmp_path / "log").events()) == list(LogReader(tmp_path / "arrow").events())
    followed = [b for b in LogReader(tmp_path / "log").follow(idle_timeout_s=0.0)]
    assert pa.Table.from_batches(followed).column("seq").to_pylist() == list(range(len(events)))


def test_what_json_cannot_carry_exactly_is_framed_as_arrow(tmp_path: Path) -> None:
    call = dict(execution_id="e", call_id="c", cell_id="cell0")
    cannot = [
        [ModelCallStarted(**call), ModelCallFinished(**call, latency_s=float("inf"))],  # JSON has no infinity
        [RoleSwitchRequested(cell_id="cell0", from_role="rollout", to_role="training",  # a nested field
                             redirects=[Redirect(call_id="c", execution_id="e", to_cell_id="cell1")])],
        [ModelCallStarted(**call, step=2**60)],  # beyond JSON's exact integers
    ]
    logprobs = [float("-inf"), -0.1, -1e-30, -3.4e38, 0.0]  # packed: exact, infinities and float32 rounding too
    can = [ModelCallStarted(**call), ModelCallFinished(**call, output_ids=[3, 0, 2**31 - 1, 7, 8],
                                                       output_logprobs=logprobs)]
    with LogWriter(tmp_path / "log", run_id="r") as writer:
        for events in [*cannot, can]:
            writer.append(events)
            writer.commit()
    _write(tmp_path / "arrow", [e for events in [*cannot, can] for e in events], row_frames=False, per_commit=100)
    assert _bodies(tmp_path / "log") == [b"\xff", b"\xff", b"\xff", b"["]
    back = list(LogReader(tmp_path / "log").events())
    assert back[1].latency_s == float("inf")
    assert back[2].redirects[0].to_cell_id == "cell1"
    assert back[3].step == 2**60
    assert back[5].output_ids == [3, 0, 2**31 - 1, 7, 8]
    assert back[5].output_logprobs[0] == float("-inf")
    assert [e.model_dump(exclude={"ts", "run_id"}) for e in back] == [
        e.model_dump(exclude={"ts", "run_id"}) for e in LogReader(tmp_path / "arrow").events()]
