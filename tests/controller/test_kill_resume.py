"""kill -9 a training run at 20+ seeded points (rollout, mid-step, publish, resume itself), resume each time:
the run completes with every reward counted once, gapless policy versions and an exact replay."""

import os
import shutil
import signal
from pathlib import Path

import pytest

from gyre.config import (
    CheckpointSection,
    EvaluationSection,
    RolloutSection,
    SamplingSection,
    TrainConfig,
    TrainerSection,
)
from gyre.log import LogReader, LogWriter
from gyre.run.history import heldout_recorded
from gyre.train.crash import run_child, torture, warm
from gyre.train.inprocess import TrainingRun
from gyre.trainer.weights import WeightsError, file_sha256

QUICK = Path(__file__).parent / "quick"


def test_killed_at_twenty_points_and_resumed_nothing_is_lost_or_doubled(tmp_path: Path) -> None:
    config = TrainConfig(
        name="crash", run_dir=tmp_path / "run", seed=2, steps=8,
        rollout=RolloutSection(tasks=QUICK / "tasks.toml", harness=QUICK / "harness.toml", task_ids=("hello",),
                               groups_per_step=1, group_size=2, max_concurrency=2, timeout_s=30),
        sampling=SamplingSection(max_tokens=8),
        trainer=TrainerSection(lr=1e-3, eps_low=0.2, eps_high=0.28),
        checkpoint=CheckpointSection(every_steps=2),  # steps after a checkpoint are retrained on resume
    )
    report = torture(config, points=20, seed=11)
    assert report.ok, report.problems
    assert len(report.kill_points) >= 20
    assert report.executions == 16 and report.rewards == 16
    assert report.versions == list(range(1, 9))
    # during rollout, mid-step and during publish (the first points), then seeded phase events
    assert report.kill_points[:3] == [("reward_recorded", 1), ("micro_step_claimed", 1), ("weights_published", 1)]


def quick_config(run_dir: Path, steps: int) -> TrainConfig:
    return TrainConfig(
        name="retrain", run_dir=run_dir, seed=4, steps=steps,
        rollout=RolloutSection(tasks=QUICK / "tasks.toml", harness=QUICK / "harness.toml", task_ids=("hello",),
                               groups_per_step=1, group_size=2, max_concurrency=2, timeout_s=30),
        sampling=SamplingSection(max_tokens=8), trainer=TrainerSection(lr=1e-3, eps_low=0.2, eps_high=0.28),
        checkpoint=CheckpointSection(every_steps=5),  # no checkpoint: a resume retrains every step
    )


def test_a_resume_retrains_logged_steps_to_the_logged_checksums(tmp_path: Path) -> None:
    config = quick_config(tmp_path / "run", steps=1)
    TrainingRun(config).run()
    notes: list[dict] = []
    resumed = TrainingRun(config, lambda phase, figures: notes.append(figures) if phase == "resumed" else None,
                          resume=True)
    resumed.close()
    assert notes == [{"aborted_step": None, "retrained_steps": 1, "version": 1}]
    # The weights file is lost: the retrained step's identical bytes restore it.
    (config.run_dir / "weights" / "v000001.safetensors").unlink()
    TrainingRun(config, resume=True).close()
    [published] = LogReader(config.run_dir / "log").events(kinds=["weights_published"])
    assert file_sha256(config.run_dir / published.location) == published.sha256


def test_a_resume_that_cannot_reproduce_the_logged_weights_stops(tmp_path: Path) -> None:
    config = quick_config(tmp_path / "run", steps=1)
    TrainingRun(config).run()
    events = list(LogReader(config.run_dir / "log").events())
    shutil.rmtree(config.run_dir / "log")
    with LogWriter(config.run_dir / "log", run_id=events[0].run_id) as writer:  # a log whose checksum lies
        writer.append([e.model_copy(update={"seq": None, "sha256": "0" * 64} if e.kind == "weights_published"
                                    else {"seq": None}) for e in events])
    with pytest.raises(WeightsError, match="did not reproduce the logged weights of version 1"):
        TrainingRun(config, resume=True)


def test_a_resume_runs_again_the_held_out_evaluation_a_kill_cut(tmp_path: Path) -> None:
    """Killed during the final evaluation, a run resumes to record it: the executions already scored count,
    the rest run again as new attempts — none is scored twice.

    The kill lands when the controller folds the final evaluation's first reward (counted among the final
    evaluation's own: how many training rewards come first depends on timing); how many of its rewards were
    durable by then is read from the log, not assumed (none, or all three, on a loaded machine)."""
    held = tmp_path / "heldout"
    held.mkdir()
    shutil.copy(QUICK / "score.py", held)
    (held / "tasks.toml").write_text((QUICK / "tasks.toml").read_text().replace('id = "hello"', 'id = "hello-held"'))
    config = quick_config(tmp_path / "run", steps=1).model_copy(
        update={"evaluation": EvaluationSection(every=1, tasks=held / "tasks.toml", samples=3)})
    warm(config)
    pid = os.fork()
    if pid == 0:
        run_child(config, resume=False, kill_at=("reward_recorded", 1, "heldout-s1-"), notes=tmp_path / "notes")
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    log = config.run_dir / "log"
    assert heldout_recorded(log) == {0}
    before = [e.execution_id for e in LogReader(log).events(kinds=["reward_recorded"])
              if e.execution_id.startswith("heldout-s1-")]
    said: list[tuple[str, dict]] = []
    TrainingRun(config, lambda phase, figures: said.append((phase, figures)), resume=True).run()
    assert heldout_recorded(log) == {0, 1}
    # the ones scored before the kill are kept, the others run again (the resume's resubmission may score some
    # before the redo counts what is left)
    [redo] = [figures for phase, figures in said if phase == "heldout-redo"]
    assert redo["step"] == 1 and 0 <= redo["unscored"] <= 3 - len(before)
    [final] = [e for e in LogReader(log).events(kinds=["heldout_evaluated"]) if e.step == 1]
    assert (final.executions, final.scored, final.policy_version) == (3, 3, 1)
    scored = [e.execution_id for e in LogReader(log).events(kinds=["reward_recorded"])]
    assert len(scored) == len(set(scored))
    assert [sum(e.startswith(f"heldout-s{step}-") for e in scored) for step in (0, 1)] == [3, 3]
