"""One real training loop on the CPU: rollouts through the proxy, rewards, a GSPO step, weights pushed."""

from pathlib import Path

import torch

from gyre.log import LogReader
from gyre.train.config import RolloutSection, SamplingSection, TrainConfig, TrainerSection
from gyre.train.loop import TrainingRun


def test_two_steps_end_to_end(tmp_path: Path) -> None:
    config = TrainConfig(
        name="smoke", run_dir=tmp_path / "run", seed=3, steps=2,
        rollout=RolloutSection(task_ids=("hello",), groups_per_step=1, group_size=4, max_concurrency=4,
                               timeout_s=60),
        sampling=SamplingSection(max_tokens=24),
        trainer=TrainerSection(lr=1e-3, eps_low=0.2, eps_high=0.28),
    )
    run = TrainingRun(config)
    try:
        before = {name: tensor.detach().clone() for name, tensor in run.backend.named_tensors()}
        first = run.step(0)
        assert first.executions == 4 and first.scored == 4 and first.micro_steps >= 1
        assert run.policy_version == 1
        changed = [name for name, tensor in run.backend.named_tensors() if not torch.equal(tensor, before[name])]
        assert changed, "the optimizer step changed no weight"
        assert run.engine.model_info().weight_version == "1"  # the engine serves the new policy
        second = run.step(1)
        assert second.policy_version == 1
    finally:
        run.close()

    con = LogReader(config.run_dir / "log").duckdb()
    rewards = con.execute("select count(*), min(reward), max(reward) from rewards").fetchone()
    assert rewards[0] == 8 and 0 <= rewards[1] <= rewards[2] <= 1
    versions = con.execute("select execution_id, max(policy_version) from model_calls group by 1 "
                           "order by 1").fetchall()
    assert {e: v for e, v in versions if e.startswith("s0-")} == {f"s0-g0-e{i}": 0 for i in range(4)}
    assert {e: v for e, v in versions if e.startswith("s1-")} == {f"s1-g0-e{i}": 1 for i in range(4)}
    steps = con.execute("select step, policy_version from train_steps order by step").fetchall()
    assert steps == [(0, 1), (1, 2)]
    published = con.execute("select policy_version from weights_published order by seq").fetchall()
    assert published == [(1,), (2,)]
    claims = con.execute("select step, cell_id, count(*) from micro_step_claims group by all order by 1").fetchall()
    assert all(cell == "cell0" for _, cell, _ in claims)


def test_ctrl_c_stops_cleanly_with_the_log_committed(tmp_path: Path) -> None:
    import os
    import signal

    import pytest

    config = TrainConfig(
        name="interrupt", run_dir=tmp_path / "run", seed=1, steps=3,
        rollout=RolloutSection(task_ids=("hello",), groups_per_step=1, group_size=2, max_concurrency=2,
                               timeout_s=60),
        sampling=SamplingSection(max_tokens=16),
    )
    sent = []

    def progress(phase: str, figures: dict) -> None:
        if phase == "rolling" and not sent:  # harnesses are running: interrupt as a user would
            sent.append(figures["running"])
            os.kill(os.getpid(), signal.SIGINT)

    run = TrainingRun(config, progress)
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert sent
    last = list(LogReader(config.run_dir / "log").events())[-1]
    assert last.kind == "run_finished" and last.status == "interrupted"
    LogReader(config.run_dir / "log").verify()
    assert run.runner.running == 0  # the harness process groups were killed, not left behind
