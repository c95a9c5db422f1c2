"""A realistic multi-cell run written through the real log writer: rollouts with a heavy tail, role switches
with the watermark, train steps with every metric, held-out evaluations. Deterministic (seeded, fixed
timestamps), so tests can check figures exactly."""

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gyre.events.models import (
    CellRegistered,
    Event,
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    HeldOutEvaluated,
    RewardRecorded,
    RoleSwitchCompleted,
    RoleSwitchRequested,
    RunFinished,
    RunStarted,
    TrainStepFinished,
)
from gyre.log import LogWriter

T0 = datetime(2026, 1, 1, tzinfo=UTC)
CELLS = ("cell0", "cell1", "cell2")
PER_STEP = 8


def metrics(step: int) -> dict:
    return dict(
        tokens_trained=900 + step, tokens_padded=1300 + step, tokens_per_s=5000.0 + step, clip_fraction=0.1 * step,
        tis_truncated_fraction=0.01, log_ratio_mean=0.02, log_ratio_max=0.3, kl=1e-3 * (step + 1),
        entropy=2.0 - 0.1 * step, response_tokens_mean=40.0, response_tokens_max=64, reward_mean=0.2 + 0.1 * step,
        reward_std=0.2, group_reward_std=0.15, groups_zero_variance=0, advantage_mean=0.0, advantage_std=0.9,
        advantage_min=-1.5, advantage_max=1.5, rollout_s=30.0, batch_s=0.5, forward_backward_s=4.0, optimizer_s=0.2,
    )


def run_events(steps: int = 4, seed: int = 0) -> list[tuple[float, Event]]:
    rng = random.Random(seed)
    out: list[tuple[float, Event]] = [
        (0.0, RunStarted(run_id="r1", name="synthetic", policy="elastic", policy_version="test/1")),
        *((0.0, CellRegistered(cell_id=c, role="rollout", is_core=c == "cell0", slots=4)) for c in CELLS),
    ]
    t = 1.0
    for step in range(steps):
        out.append((t, HeldOutEvaluated(step=step, policy_version=step, tasks=2, executions=4, scored=4,
                                        passed=min(4, step), pass_threshold=1.0, pass_rate=min(4, step) / 4,
                                        reward_mean=0.3 + 0.1 * step, group_prefix=f"heldout-s{step}-")))
        ends = []
        for i in range(PER_STEP):
            execution = f"s{step}-e{i}"
            duration = 10.0 + rng.paretovariate(1.5) * 5  # heavy tail
            out += [(t, ExecutionQueued(execution_id=execution, task_id="t", group_id=f"s{step}-g{i // 4}",
                                        policy_version=step)),
                    (t, ExecutionStarted(execution_id=execution, cell_id=CELLS[i % 3])),
                    (t + duration, ExecutionFinished(execution_id=execution, status="completed", duration_s=duration)),
                    (t + duration, RewardRecorded(execution_id=execution, reward=round(rng.random(), 3)))]
            ends.append(t + duration)
        ends.sort()
        # elastic: cell2 leaves rollout once 6 of 8 are done, the rest once all are
        early = ends[5]
        out += [(early, RoleSwitchRequested(cell_id="cell2", from_role="rollout", to_role="training", watermark=2)),
                (early + 8.5, RoleSwitchCompleted(cell_id="cell2", from_role="rollout", to_role="training",
                                                  duration_s=8.5))]
        last = ends[-1]
        for cell in ("cell0", "cell1"):
            out += [(last, RoleSwitchRequested(cell_id=cell, from_role="rollout", to_role="training", watermark=0)),
                    (last + 8.0, RoleSwitchCompleted(cell_id=cell, from_role="rollout", to_role="training",
                                                     duration_s=8.0))]
        done = last + 20.0
        out.append((done, TrainStepFinished(step=step, policy_version=step + 1, micro_steps=2, samples=PER_STEP,
                                            tokens=1200 + step, loss=0.0, grad_norm=0.5, duration_s=12.0,
                                            **metrics(step))))
        for cell in CELLS:
            out += [(done, RoleSwitchRequested(cell_id=cell, from_role="training", to_role="rollout", watermark=8)),
                    (done + 3.5, RoleSwitchCompleted(cell_id=cell, from_role="training", to_role="rollout",
                                                     duration_s=3.5))]
        t = done + 4.0
    out.append((t, HeldOutEvaluated(step=steps, policy_version=steps, tasks=2, executions=4, scored=3, passed=3,
                                    pass_threshold=1.0, pass_rate=1.0, reward_mean=0.9, group_prefix="heldout-s9-")))
    out.append((t + 1, RunFinished(run_id="r1", status="completed")))
    return out


def write_run(log: Path, steps: int = 4, seed: int = 0) -> list[Event]:
    """Write the run into a new log; returns its events as written (seq and ts set)."""
    timed = sorted(run_events(steps, seed), key=lambda item: item[0])
    events = [e.model_copy(update={"ts": T0 + timedelta(seconds=t)}) for t, e in timed]
    with LogWriter(log, run_id="r1") as writer:
        writer.append(events)
        writer.commit()
    from gyre.log import LogReader

    return list(LogReader(log).events())
