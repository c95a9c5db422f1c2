"""One real training run on the CPU, driven by the controller: rollouts through the proxy, rewards, GSPO
steps, durable weights pushed into the engine on each return to rollout — and a log that replays exactly."""

import os
import signal
from pathlib import Path

import pytest
import torch

from gyre.config import RolloutSection, SamplingSection, TrainConfig, TrainerSection
from gyre.errors import ConfigError
from gyre.events.models import RoleSwitchRequested
from gyre.log import LogReader, LogWriter
from gyre.replay.exact import replay_decisions
from gyre.train.inprocess import TrainingRun
from gyre.trainer.weights import file_sha256


def smoke_config(run_dir: Path, steps: int = 2) -> TrainConfig:
    return TrainConfig(
        name="smoke", run_dir=run_dir, seed=3, steps=steps,
        rollout=RolloutSection(task_ids=("hello",), groups_per_step=1, group_size=4, max_concurrency=4,
                               timeout_s=60),
        sampling=SamplingSection(max_tokens=24),
        trainer=TrainerSection(lr=1e-3, eps_low=0.2, eps_high=0.28),
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    config = smoke_config(tmp_path_factory.mktemp("train") / "run")
    summary = TrainingRun(config).run()
    return config, summary


def test_two_steps_end_to_end(trained) -> None:
    config, summary = trained
    assert summary.status == "completed" and summary.policy_version == 2
    assert [(r.step, r.executions, r.scored) for r in summary.steps] == [(0, 4, 4), (1, 4, 4)]
    assert all(r.micro_steps >= 1 for r in summary.steps)
    con = LogReader(config.run_dir / "log").duckdb()
    rewards = con.execute("select count(*), min(reward), max(reward) from rewards").fetchone()
    assert rewards[0] == 8 and 0 <= rewards[1] <= rewards[2] <= 1
    versions = dict(con.execute("select q.step, max(c.policy_version) from model_calls c "
                                "join executions_queued q using (execution_id) group by 1").fetchall())
    assert versions == {0: 0, 1: 1}  # step 1 rolled out on the weights step 0 published
    assert con.execute("select step, policy_version from train_steps order by step").fetchall() == [(0, 1), (1, 2)]
    ids = [r[0] for r in con.execute("select execution_id from executions_queued").fetchall()]
    assert all(e.startswith(summary.run_id + ".") for e in ids)  # ids are unique per run


def test_export_writes_a_published_version_as_a_checkpoint_that_loads(trained, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from gyre.errors import ConfigError
    from gyre.trainer.export import export_policy

    config, summary = trained
    written = export_policy(config.run_dir, tmp_path / "v1", version=1)
    assert (written.run_id, written.version) == (summary.run_id, 1)
    [published] = [e for e in LogReader(config.run_dir / "log").events(kinds=["weights_published"])
                   if e.policy_version == 1]
    exported = load_file(next((tmp_path / "v1").glob("*.safetensors")))
    logged = load_file(config.run_dir / published.location)
    assert all(torch.equal(exported[name], tensor) for name, tensor in logged.items() if name in exported)
    assert export_policy(config.run_dir, tmp_path / "last").version == 2  # the last published by default
    with pytest.raises(ConfigError, match=r"published no version 7; it has \[1, 2\]"):
        export_policy(config.run_dir, tmp_path / "v7", version=7)


def test_weights_are_durable_files_with_their_checksums(trained) -> None:
    config, _ = trained
    con = LogReader(config.run_dir / "log").duckdb()
    published = con.execute("select policy_version, location, sha256, bytes from weights_published "
                            "order by seq").fetchall()
    assert [p[0] for p in published] == [1, 2]
    for _, location, sha256, size in published:
        path = config.run_dir / location
        assert file_sha256(path) == sha256 and path.stat().st_size == size


def test_the_log_replays_exactly_and_switches_carry_their_measured_parts(trained) -> None:
    config, _ = trained
    report = replay_decisions(config.run_dir / "log")
    assert report.mismatches == [] and report.decisions > 0, report.to_dict()
    con = LogReader(config.run_dir / "log").duckdb()
    switches = con.execute("select to_role, duration_s, drain_s, engine_pause_s, trainer_join_s, weights_bytes, "
                           "weights_s, engine_resume_s from role_switches order by seq").fetchall()
    assert [s[0] for s in switches] == ["training", "rollout", "training"]
    leave, back = switches[0], switches[1]
    assert all(part is not None for part in leave[2:5]) and leave[1] >= sum(leave[2:5])
    assert back[5] > 0 and back[6] > 0 and back[7] is not None and back[1] >= back[6]


def test_an_altered_decision_fails_replay(trained, tmp_path) -> None:
    config, _ = trained
    events = list(LogReader(config.run_dir / "log").events())
    target = next(i for i, e in enumerate(events) if isinstance(e, RoleSwitchRequested))
    events[target] = events[target].model_copy(update={"to_role": "rollout", "from_role": "training"})
    with LogWriter(tmp_path / "tampered", run_id=events[0].run_id) as writer:
        writer.append([e.model_copy(update={"seq": None}) for e in events])
    assert len(replay_decisions(tmp_path / "tampered").mismatches) == 1


def test_a_second_run_into_the_same_directory_is_refused(trained) -> None:
    config, summary = trained
    with pytest.raises(ConfigError, match=f"already holds the log of run {summary.run_id}.*--resume"):
        TrainingRun(config)


def test_resume_refuses_a_different_config(trained) -> None:
    config, _ = trained
    with pytest.raises(ConfigError, match=r"differs from the one run .* steps: recorded 2, given 3"):
        TrainingRun(config.model_copy(update={"steps": 3}), resume=True)


def test_ctrl_c_stops_cleanly_with_the_log_committed(tmp_path: Path) -> None:
    config = TrainConfig(
        name="interrupt", run_dir=tmp_path / "run", seed=1, steps=3,
        rollout=RolloutSection(task_ids=("hello",), groups_per_step=1, group_size=2, max_concurrency=2,
                               timeout_s=60),
        sampling=SamplingSection(max_tokens=16),
    )
    sent = []

    def progress(phase: str, figures: dict) -> None:
        if phase == "rolling" and figures["running"] and not sent:  # harnesses run: interrupt as a user would
            sent.append(figures["running"])
            os.kill(os.getpid(), signal.SIGINT)

    run = TrainingRun(config, progress)
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert sent
    last = list(LogReader(config.run_dir / "log").events())[-1]
    assert last.kind == "run_finished" and last.status == "interrupted"
    LogReader(config.run_dir / "log").verify()
    assert run.topology.runner.running == 0  # the harness process groups were killed, not left behind


def test_counterfactual_replay_retimes_a_live_log(trained) -> None:
    from gyre.replay.counterfactual import retime

    config, _ = trained
    for policy in ("colocate", "elastic"):
        measured = retime(config.run_dir / "log", policy)  # costs measured from the log itself
        borrowed = retime(config.run_dir / "log", policy, scenario="tiny")
        assert measured["steps"] == borrowed["steps"] == 2 and measured["executions"] == 8


def test_retiming_a_live_run_charges_each_step_its_recorded_training_time(trained) -> None:
    """The simulator charges a step its executions' tokens at the measured rate; the rate must be measured
    over those same tokens, or the re-timed training is off by forwarded/workload tokens (3.7x on the
    live comparison's async run)."""
    from gyre.events.models import RunStarted
    from gyre.replay.counterfactual import measured_scenario, workload_from_log

    config, _ = trained
    log = config.run_dir / "log"
    start = next(LogReader(log).events(to_seq=0))
    assert isinstance(start, RunStarted)
    scenario = measured_scenario(log, start)
    workload = workload_from_log(log, scenario)
    charged = sum(e.tokens for batch in workload.batches for e in batch) * scenario.training.s_per_mtoken / 1e6
    (recorded,) = LogReader(log).duckdb().execute("select sum(duration_s) from train_steps where tokens > 0").fetchone()
    assert charged == pytest.approx(recorded, rel=1e-6)

