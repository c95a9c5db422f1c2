"""Exporters read the log, and what they write is read back with each tool's own format: TensorBoard's
event-file reader, and the records of the W&B offline run file."""

import json
import struct
import threading
import zlib
from pathlib import Path

import pytest
from run_log import T0, metrics, write_run

from gyre.events.models import HeldOutEvaluated, RunFinished, RunStarted, TrainStepFinished
from gyre.log import LogWriter
from gyre.observe import LogFollower, Scalar, TensorBoardExporter, export_log, make_exporters, scalars

STEPS = 3


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of the W&B offline run under ``run_dir`` (its LevelDB-log-framed record file)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's trailer too short for a header is padding
            pos += block - pos % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0:
            continue
        assert checksum == zlib.crc32(bytes([kind]) + chunk), f"bad record checksum at {pos}"
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export")
    write_run(path / "log", steps=STEPS)
    return path


def test_scalars_of_a_train_step_and_a_heldout_evaluation() -> None:
    step = TrainStepFinished(step=2, policy_version=3, micro_steps=1, tokens=10, loss=0.0, ts=T0, **metrics(2))
    values = {s.tag: s.value for s in scalars(step)}
    assert values["train/clip_fraction"] == pytest.approx(0.2) and values["train/tokens"] == 10
    assert "train/policy_version" not in values and {s.step for s in scalars(step)} == {2}
    heldout = HeldOutEvaluated(step=1, policy_version=1, tasks=1, executions=2, scored=0, passed=0,
                               pass_threshold=1.0, pass_rate=None)
    assert {s.tag for s in scalars(heldout)} == {"heldout/tasks", "heldout/executions", "heldout/scored",
                                                 "heldout/passed", "heldout/pass_threshold", "heldout/duration_s"}
    assert scalars(RunFinished(run_id="r", status="completed")) == []


def test_tensorboard_files_hold_every_metric(run_dir: Path, tmp_path: Path) -> None:
    exporter = TensorBoardExporter(tmp_path / "tb")
    export_log(run_dir / "log", [exporter])
    exporter.close()
    written = tensorboard_scalars(tmp_path / "tb")
    assert written["train/clip_fraction"] == [(s, pytest.approx(0.1 * s)) for s in range(STEPS)]
    assert written["train/kl"] == [(s, pytest.approx(1e-3 * (s + 1))) for s in range(STEPS)]
    assert written["heldout/pass_rate"] == [(0, 0.0), (1, 0.25), (2, 0.5), (3, 1.0)]
    for tag in ("train/entropy", "train/tokens_trained", "train/reward_mean", "train/advantage_std",
                "train/rollout_s", "train/log_ratio_max", "train/tis_truncated_fraction", "heldout/reward_mean"):
        assert tag in written


def test_wandb_offline_run_holds_every_metric(run_dir: Path) -> None:
    (exporter,) = make_exporters(["wandb"], run_dir, run_name="synthetic", project="gyre-test")
    export_log(run_dir / "log", [exporter])
    exporter.close()
    rows = wandb_history(run_dir)
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step.setdefault(row["_step"], {}).update(row)
    assert sorted(by_step) == list(range(STEPS + 1))
    assert by_step[1]["train/clip_fraction"] == pytest.approx(0.1)
    assert by_step[2]["heldout/pass_rate"] == 0.5 and by_step[STEPS]["heldout/pass_rate"] == 1.0
    assert by_step[0]["train/entropy"] == pytest.approx(2.0)


class Probe:
    """An exporter that remembers what it got and signals when a given tag arrives."""

    def __init__(self, tag: str) -> None:
        self.tag, self.got, self.seen, self.closed = tag, [], threading.Event(), False

    def write(self, values: list[Scalar]) -> None:
        self.got += values
        if any(v.tag == self.tag for v in values):
            self.seen.set()

    def close(self) -> None:
        self.closed = True


def test_a_follower_exports_while_the_run_writes(tmp_path: Path) -> None:
    log = tmp_path / "log"
    with LogWriter(log, run_id="live") as writer:
        writer.append(RunStarted(run_id="live", name="live", policy="colocate", policy_version="x"))
        writer.commit()
        probe, board = Probe("train/kl"), TensorBoardExporter(tmp_path / "tb")
        follower = LogFollower(log, [probe, board], poll_s=0.01).start()
        writer.append(TrainStepFinished(step=0, policy_version=1, micro_steps=1, **metrics(0)))
        writer.commit()
        assert probe.seen.wait(60), "the follower did not export a committed train step"
        writer.append(TrainStepFinished(step=1, policy_version=2, micro_steps=1, **metrics(1)))
        writer.commit()
        follower.close()  # exports what was committed since, then closes the exporters
    assert probe.closed and [v.step for v in probe.got if v.tag == "train/kl"] == [0, 1]
    assert [step for step, _ in tensorboard_scalars(tmp_path / "tb")["train/kl"]] == [0, 1]


def test_following_until_the_run_finishes(run_dir: Path) -> None:
    probe = Probe("heldout/pass_rate")
    follower = LogFollower(run_dir / "log", [probe], poll_s=0.01, until_finished=True).start()
    assert follower.wait(60)
    follower.close()
    assert [v.value for v in probe.got if v.tag == "heldout/pass_rate"] == [0.0, 0.25, 0.5, 1.0]


def test_unknown_exporter_is_named(tmp_path: Path) -> None:
    from gyre.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'mlflow'.*tensorboard"):
        make_exporters(["mlflow"], tmp_path, run_name="x")


def test_export_command_after_the_run_and_following_a_finished_one(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gyre.cli import app

    write_run(tmp_path / "log", steps=2)
    result = CliRunner().invoke(app, ["metrics", str(tmp_path), "--to", "tensorboard"])
    assert result.exit_code == 0, result.output
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tensorboard")["train/entropy"]] == [0, 1]
    followed = CliRunner().invoke(app, ["metrics", str(tmp_path), "--to", "tensorboard", "--follow"])
    assert followed.exit_code == 0, followed.output  # ends by itself at run_finished
    bad = CliRunner().invoke(app, ["metrics", str(tmp_path / "none"), "--to", "tensorboard"])
    assert bad.exit_code == 2 and "no log at" in bad.output
