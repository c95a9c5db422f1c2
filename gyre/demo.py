"""`make demo`: until the training loop lands, write a small recorded run and query it.

The run is a deterministic, hand-scripted miniature of what Gyre records: two cells, a group of
executions with branching model calls, rewards (one partial, one evaluator failure), a role switch and a
training step. It then shows `gyre log stats` and a DuckDB query over the log.
"""

import random
import shutil
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from gyre.events.models import (
    CellRegistered,
    EvaluationFailed,
    Event,
    ExecutionFinished,
    ExecutionQueued,
    ExecutionStarted,
    MicroStepClaimed,
    MicroStepFinished,
    ModelCallFinished,
    ModelCallStarted,
    RewardRecorded,
    RoleSwitchCompleted,
    RoleSwitchRequested,
    RunFinished,
    RunStarted,
    TrainStepFinished,
    TrainStepStarted,
    WeightsPublished,
)
from gyre.log import LogWriter

RUN_DIR = Path("runs/demo")


def demo_events(seed: int = 0, executions: int = 8) -> list[Event]:
    rng = random.Random(seed)
    clock = datetime(2026, 1, 1, tzinfo=UTC)

    def at(seconds: float) -> datetime:
        return clock + timedelta(seconds=seconds)

    events: list[Event] = [
        RunStarted(run_id="demo", name="demo", policy="elastic", policy_version="1", seed=seed, ts=at(0)),
        CellRegistered(cell_id="cell0", role="training", is_core=True, gpus=8, slots=4, ts=at(0)),
        CellRegistered(cell_id="cell1", role="rollout", gpus=8, slots=8, ts=at(0)),
    ]
    t = 1.0
    for e in range(executions):
        execution = f"exec{e}"
        events.append(ExecutionQueued(execution_id=execution, task_id="task0", group_id="group0", ts=at(t)))
        events.append(ExecutionStarted(execution_id=execution, cell_id="cell1", ts=at(t + 0.1)))
        parent, full_len = None, 0
        for c in range(rng.randint(3, 6)):
            call = f"{execution}-call{c}"
            branch = "sub-agent" if c == 2 else "main"
            t += rng.uniform(1, 5)
            delta = [rng.randrange(256) for _ in range(rng.randint(20, 60))]
            output = [rng.randrange(256) for _ in range(rng.randint(5, 30))]
            root = branch == "sub-agent"
            events.append(ModelCallStarted(execution_id=execution, call_id=call, cell_id="cell1",
                                           parent_call_id=None if root else parent, branch=branch, ts=at(t)))
            events.append(ModelCallFinished(
                execution_id=execution, call_id=call, cell_id="cell1", parent_call_id=None if root else parent,
                branch=branch, prefix_len=0 if root else full_len, prompt_delta_ids=delta, output_ids=output,
                output_logprobs=[-rng.expovariate(2) for _ in output], latency_s=rng.uniform(0.2, 2),
                ts=at(t + 0.5)))
            if not root:
                parent, full_len = call, full_len + len(delta) + len(output)
        status = "timed_out" if e == 5 else "completed"
        events.append(ExecutionFinished(execution_id=execution, status=status, duration_s=t, ts=at(t + 1)))
        if e == 6:
            events.append(EvaluationFailed(execution_id=execution, error="crash", evaluator="pytest",
                                           message="evaluator crashed: excluded, never a zero", ts=at(t + 2)))
        else:
            events.append(RewardRecorded(execution_id=execution, reward=round(rng.random(), 2),
                                         partial=status == "timed_out", evaluator="pytest", ts=at(t + 2)))
    t += 3
    events += [
        RoleSwitchRequested(cell_id="cell1", from_role="rollout", to_role="training", watermark=0,
                            reason="no running or queued executions", ts=at(t)),
        RoleSwitchCompleted(cell_id="cell1", from_role="rollout", to_role="training", duration_s=8.52,
                            ts=at(t + 8.52)),
        TrainStepStarted(step=0, policy_version=0, planned_micro_steps=2, groups=1, trajectories=7,
                         ts=at(t + 9)),
        MicroStepClaimed(step=0, cell_id="cell0", micro_step=0, ts=at(t + 9)),
        MicroStepClaimed(step=0, cell_id="cell1", micro_step=1, ts=at(t + 9)),
        MicroStepFinished(step=0, cell_id="cell0", micro_step=0, loss=0.12, ts=at(t + 11)),
        MicroStepFinished(step=0, cell_id="cell1", micro_step=1, loss=0.10, ts=at(t + 11.5)),
        TrainStepFinished(step=0, policy_version=1, micro_steps=2, samples=7, loss=0.11, ts=at(t + 12)),
        WeightsPublished(policy_version=1, tensors=24, bytes=3_600_000, ts=at(t + 13)),
        RunFinished(run_id="demo", status="completed", ts=at(t + 14)),
    ]
    return events


def main() -> None:
    log_path = RUN_DIR / "log"
    if RUN_DIR.exists():
        shutil.rmtree(RUN_DIR)
    with LogWriter(log_path, run_id="demo") as writer:
        writer.append(demo_events())
    gyre = [sys.executable, "-m", "gyre"]
    print(f"wrote a demo run to {log_path}\n")
    subprocess.run([*gyre, "log", "verify", str(log_path)], check=True)
    subprocess.run([*gyre, "log", "stats", str(log_path)], check=True)
    query = ("SELECT e.execution_id, f.status, count(c.seq) AS calls, sum(len(c.output_ids)) AS policy_tokens, "
             "r.reward, r.partial, x.error AS evaluation_error "
             "FROM executions_finished f JOIN executions_queued e USING (execution_id) "
             "LEFT JOIN model_calls c USING (execution_id) LEFT JOIN rewards r USING (execution_id) "
             "LEFT JOIN evaluation_failures x USING (execution_id) "
             "GROUP BY ALL ORDER BY e.execution_id")
    print(f"\n$ gyre log sql {log_path} \"{query}\"")
    subprocess.run([*gyre, "log", "sql", str(log_path), query], check=True)


if __name__ == "__main__":
    main()
