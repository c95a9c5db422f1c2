"""Bounded frames, and what every command does with a damaged log: a clear error naming the segment and
the byte offset, never a traceback; `verify` reports a torn tail with its size and fails on it unless told
`--allow-torn-tail`. Old frame formats stay readable and writable."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from benchmarks.log_bench import model_call_batch
from gyre.cli import app
from gyre.events import encode
from gyre.events.models import RewardRecorded
from gyre.events.schema import payload_type
from gyre.log import LogReader, LogWriter
from gyre.log import writer as writer_module
from gyre.log.frames import BATCH_FRAME, CLOSE_FRAME, FORMAT_V0, Frame, scan
from gyre.sim.runner import simulate
from gyre.sim.scenario import load_scenario
from gyre.sink import LogSink

runner = CliRunner()


def _batch_frames(path: Path) -> list[Frame]:
    out = []
    for segment in sorted(path.glob("*.seg")):
        out += [f for f in scan(memoryview(segment.read_bytes()))
                if isinstance(f, Frame) and f.frame_type == BATCH_FRAME]
    return out


def test_a_giant_batch_becomes_bounded_frames(log_dir: Path) -> None:
    rows = 150_000  # more rows than one frame may hold
    struct = payload_type("micro_step_claimed")
    claims = pa.RecordBatch.from_pydict({
        "kind": pa.array(["micro_step_claimed"] * rows), "cell_id": pa.array(["cell1"] * rows),
        "step": pa.array(np.full(rows, 3, np.int64)),
        "micro_step_claimed": pa.StructArray.from_arrays(
            [pa.array(np.arange(rows, dtype=np.int64)), pa.array(np.full(rows, 7, np.int64))], fields=list(struct)),
    })
    calls = model_call_batch(0, 600, 2048, np.random.default_rng(0))  # ~9.8 MB: more bytes than one frame
    with LogWriter(log_dir) as writer:
        assert writer.append_batch(claims) == (0, rows - 1)
        assert writer.append_batch(calls) == (rows, rows + 599)
    frames = _batch_frames(log_dir)
    assert max(f.count for f in frames) <= writer_module.MAX_FRAME_ROWS
    assert max(len(f.payload) for f in frames) <= writer_module.MAX_FRAME_BYTES * 1.01
    assert len(frames) >= 3 + 2
    assert [f.first_seq for f in frames] == [0] + [f.last_seq + 1 for f in frames[:-1]]  # gapless
    back = LogReader(log_dir).table()
    assert back.column("seq").to_pylist() == list(range(rows + 600))
    assert back.column("micro_step_claimed").combine_chunks().field("micro_step").to_pylist()[:rows] == list(
        range(rows))


def test_event_runs_and_the_simulator_sink_write_bounded_frames(log_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(writer_module, "MAX_FRAME_ROWS", 100)
    monkeypatch.setattr(LogSink, "COMMIT_EVENTS", 250)
    sink = LogSink.create(log_dir, run_id="sim", flush_interval_s=None)
    for i in range(9):
        sink.record([RewardRecorded(execution_id=f"e{i}-{j}", reward=0.5) for j in range(50)])
    sink.close()
    frames = _batch_frames(log_dir)
    assert max(f.count for f in frames) <= 100 and sum(f.count for f in frames) == 450
    assert [e.execution_id for e in LogReader(log_dir).events()][-1] == "e8-49"


def test_the_old_frame_format_is_read_and_continued(log_dir: Path) -> None:
    events = [RewardRecorded(execution_id=f"e{i}", reward=0.5) for i in range(6)]
    with LogWriter(log_dir, frame_format=FORMAT_V0) as writer:  # as Gyre wrote logs before format v1
        writer.append(events[:3])
    with LogWriter(log_dir) as writer:
        writer.append_batch(encode(events[3:], 0).drop_columns(["seq", "ts"]))
    frames = [f for f in scan(memoryview(next(log_dir.glob("*.seg")).read_bytes())) if isinstance(f, Frame)]
    assert [f.chunked for f in frames] == [False, False, True, True]
    assert frames[-1].frame_type == CLOSE_FRAME
    assert [e.execution_id for e in LogReader(log_dir).events()] == [e.execution_id for e in events]
    assert LogReader(log_dir).verify().ok


@pytest.fixture(scope="module")
def sim_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sim") / "log"
    simulate(load_scenario("tiny"), "elastic", log_dir=path)
    return path


def _damaged_copy(source: Path, target: Path) -> tuple[Path, int]:
    """A copy of the log with one byte flipped in the middle of its largest frame; returns that frame's offset."""
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    segment = sorted(target.glob("*.seg"))[-1]
    frame = max(_batch_frames(target), key=lambda f: len(f.payload))
    data = bytearray(segment.read_bytes())
    data[frame.end - len(frame.payload) // 2] ^= 0x04
    segment.write_bytes(bytes(data))
    return segment, frame.offset


@pytest.mark.parametrize("verb", [["log", "verify"], ["log", "stats"], ["log", "tail"],
                                  ["log", "sql", "SELECT count(*) FROM events"], ["replay"]])
def test_every_command_names_segment_and_offset_of_a_flipped_byte(sim_log: Path, tmp_path: Path,
                                                                  verb: list[str]) -> None:
    log = tmp_path / "log"
    segment, offset = _damaged_copy(sim_log, log)
    before = segment.read_bytes()
    args = [*verb[:-1], str(log), verb[-1]] if verb[0] == "log" and len(verb) == 3 else [*verb, str(log)]
    result = runner.invoke(app, args)
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit)  # a clean exit, not an exception escaping
    text = result.output.replace("\n", "")
    assert "Traceback" not in text
    assert f"corrupt log segment {segment}" in text and f"byte offset {offset}" in text
    assert segment.read_bytes() == before
    with pytest.raises(Exception, match=f"byte offset {offset}"):  # and a writer refuses it, cutting nothing
        LogWriter(log)
    assert segment.read_bytes() == before


def test_verify_reports_a_torn_tail_and_fails_unless_allowed(sim_log: Path, tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.mkdir()
    for file in sim_log.iterdir():
        (log / file.name).write_bytes(file.read_bytes())
    segment = sorted(log.glob("*.seg"))[-1]
    last = _batch_frames(log)[-1]
    segment.write_bytes(segment.read_bytes()[:last.end - 1000])  # a crash while writing the last frame
    torn = last.end - 1000 - last.offset
    result = runner.invoke(app, ["log", "verify", str(log)])
    assert result.exit_code == 1 and f"torn tail of {torn} bytes" in result.output.replace("\n", "")
    result = runner.invoke(app, ["log", "verify", str(log), "--allow-torn-tail", "--json"])
    report = json.loads(result.output)
    assert result.exit_code == 0 and (report["tail"], report["torn_tail_bytes"]) == ("torn", torn)
    assert report["tail_events"] == last.count and report["tail_offset"] == last.offset
    stats = runner.invoke(app, ["log", "stats", str(log), "--json"])  # readers skip a torn tail
    assert stats.exit_code == 0 and json.loads(stats.output)["last_seq"] == last.first_seq - 1


def test_verify_fails_on_a_damaged_tail_nothing_proves_torn(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with LogWriter(log) as writer:
        writer.append([RewardRecorded(execution_id=f"e{i}", reward=0.5) for i in range(4)])
    segment = next(log.glob("*.seg"))
    frames = [f for f in scan(memoryview(segment.read_bytes())) if isinstance(f, Frame)]
    data = bytearray(segment.read_bytes()[:frames[-1].offset])  # as a crash leaves it: no CLOSE marker
    data[frames[-2].offset] ^= 0x01  # the last frame's magic: its header cannot be read
    segment.write_bytes(bytes(data))
    result = runner.invoke(app, ["log", "verify", str(log), "--allow-torn-tail", "--json"])
    report = json.loads(result.output)
    assert result.exit_code == 1 and report["tail"] == "ambiguous"
