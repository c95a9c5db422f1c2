"""kill -9 a training run at 20+ seeded points (rollout, mid-step, publish, resume itself), resume each time:
the run completes with every reward counted once, gapless policy versions and an exact replay."""

from pathlib import Path

from gyre.train.config import RolloutSection, SamplingSection, TrainConfig, TrainerSection
from gyre.train.crash import torture

QUICK = Path(__file__).parent / "quick"


def test_killed_at_twenty_points_and_resumed_nothing_is_lost_or_doubled(tmp_path: Path) -> None:
    config = TrainConfig(
        name="crash", run_dir=tmp_path / "run", seed=2, steps=3,
        rollout=RolloutSection(tasks=QUICK / "tasks.toml", harness=QUICK / "harness.toml", task_ids=("hello",),
                               groups_per_step=1, group_size=2, max_concurrency=2, timeout_s=30),
        sampling=SamplingSection(max_tokens=8),
        trainer=TrainerSection(lr=1e-3, eps_low=0.2, eps_high=0.28),
    )
    report = torture(config, points=20, seed=11, max_gap=4)
    assert report.ok, report.problems
    assert len(report.kill_points) >= 20
    assert report.executions == 6 and report.rewards == 6
    assert report.versions == [1, 2, 3]
