"""The command line: verify names the corrupt place, stats/tail/sql answer, schema dump stays in sync."""

import json
from pathlib import Path

from typer.testing import CliRunner

from gyre.cli import app
from gyre.demo import demo_events
from gyre.log import LogWriter
from gyre.log.frames import Frame, scan

runner = CliRunner()


def _demo_log(path: Path) -> Path:
    with LogWriter(path, run_id="demo") as writer:
        for event in demo_events():
            writer.append(event)
            writer.commit()
    return path


def test_verify_ok_and_corrupt(tmp_path: Path) -> None:
    log = _demo_log(tmp_path / "log")
    result = runner.invoke(app, ["log", "verify", str(log), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["events"] == len(demo_events())
    segment = next(log.glob("*.seg"))
    frames = [f for f in scan(memoryview(segment.read_bytes())) if isinstance(f, Frame)]
    data = bytearray(segment.read_bytes())
    target = frames[3]
    data[target.offset + 40] ^= 0x10
    segment.write_bytes(bytes(data))
    result = runner.invoke(app, ["log", "verify", str(log), "--json"])
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report == {"ok": False, "segment": str(segment), "offset": target.offset,
                      "reason": report["reason"]} and "checksum" in report["reason"]
    result = runner.invoke(app, ["log", "verify", str(log)])
    assert result.exit_code == 1 and f"byte offset {target.offset}" in result.output.replace("\n", "")


def test_stats_tail_and_sql(tmp_path: Path) -> None:
    log = _demo_log(tmp_path / "log")
    stats = json.loads(runner.invoke(app, ["log", "stats", str(log), "--json"]).output)
    assert stats["events"] == len(demo_events()) and stats["kinds"]["model_call_finished"] == 41
    tail = runner.invoke(app, ["log", "tail", str(log), "-n", "2"]).output.strip().splitlines()
    assert [json.loads(line)["kind"] for line in tail] == ["weights_published", "run_finished"]
    rewards = runner.invoke(app, ["log", "tail", str(log), "-n", "1", "--kind", "reward_recorded"]).output
    assert json.loads(rewards)["execution_id"] == "exec7"
    out = runner.invoke(app, ["log", "sql", str(log), "SELECT count(*) AS n FROM rewards", "--json"])
    assert json.loads(out.output) == [{"n": 7}]
    bad = runner.invoke(app, ["log", "sql", str(log), "SELECT nope FROM rewards"])
    assert bad.exit_code == 1 and "query failed" in bad.output
    missing = runner.invoke(app, ["log", "stats", str(tmp_path / "missing")])
    assert missing.exit_code == 2 and "no log at" in missing.output


def test_schema_dump_check(tmp_path: Path) -> None:
    out = tmp_path / "events.json"
    assert runner.invoke(app, ["schema", "dump", "--out", str(out), "--check"]).exit_code == 1
    assert runner.invoke(app, ["schema", "dump", "--out", str(out)]).exit_code == 0
    assert runner.invoke(app, ["schema", "dump", "--out", str(out), "--check"]).exit_code == 0
