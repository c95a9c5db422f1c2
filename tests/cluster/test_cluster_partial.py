"""Partial rollouts live: colocate with over-sampling on 2 cells as processes; the over-sampled group is cut
while it runs, resumes on the newer weights and is trained by the next step.

Order comes from files and the run's own events, never from sleeps (`partial/two_calls.py`): the over-sampled
group's two ``slow`` executions make their first call and wait; the step's ``fast`` executions complete only
after that, so the batch is full while the slow ones still run: colocate sends every cell to training and
the proxy cuts them (their slots released, each queued again). Once a cell is in training the test releases
them: their next call waits in the proxy until a cell admits again, with weights v1, and runs there. Step 1
trains their group (due: carried once) with step 1's own; the audit counts the cuts and a lag of one
version (allowed with partial rollouts), and replay re-derives every decision.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from gyre.cluster.config import ClusterConfig, ClusterSchedulerSection, ClusterSection
from gyre.cluster.run import ClusterRun
from gyre.config import RolloutSection, SamplingSection, TrainerSection, TrajectorySection
from gyre.log import LogReader
from gyre.replay.exact import replay_decisions
from gyre.scheduler import SchedulerFold

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent / "partial"
QUICK = Path(__file__).parents[1] / "controller" / "quick"


def tasks(directory: Path, hold: Path) -> Path:
    path = directory / "tasks.toml"
    path.write_text(f'''name = "partial"

[evaluator]
type = "command"
name = "letters"
command = ["{{python}}", "-S", "{QUICK / 'score.py'}", "{{workspace}}/{{answer_file}}"]
timeout_s = 10

[[tasks]]
id = "fast"
prompt = "HOLD {hold} fast"

[[tasks]]
id = "fast2"
prompt = "HOLD {hold} fast"

[[tasks]]
id = "slow"
prompt = "HOLD {hold} slow"
''')
    return path


def held_run(tmp_path: Path, name: str, cluster: ClusterSection,
             scheduler: ClusterSchedulerSection) -> tuple[ClusterConfig, threading.Event, Callable[[str, dict], None]]:
    """A two-step run of one over-sampled group whose slow executions wait on a file until the first switch to
    training (the cut) releases them: the config, the release's event, and the progress hook that releases."""
    hold = tmp_path / "hold"
    hold.mkdir()
    config = ClusterConfig(
        name=name, run_dir=tmp_path / "run", seed=5, steps=2, cluster=cluster, scheduler=scheduler,
        # batch s: groups (s*2 + g) % 3 of the task ids, so batch 1's first group (over-sampled) is the slow one
        rollout=RolloutSection(tasks=tasks(tmp_path, hold), harness=HERE / "harness.toml",
                               task_ids=("fast", "fast2", "slow"), groups_per_step=2, group_size=2, timeout_s=300),
        sampling=SamplingSection(max_tokens=4),
        trajectory=TrajectorySection(min_valid_per_group=2),
        trainer=TrainerSection(lr=1e-3, eps_low=0.2, eps_high=0.28),
    )
    released = threading.Event()

    def progress(phase: str, figures: dict) -> None:
        if phase == "switch" and figures.get("to") == "training" and not released.is_set():
            released.set()  # the slow ones were cut: let them go on
            (hold / "release").touch()

    return config, released, progress


def test_a_cut_execution_resumes_on_the_next_weights_and_trains_in_the_next_step(tmp_path: Path) -> None:
    config, released, progress = held_run(
        tmp_path, "partial", ClusterSection(cells=2, slots=3, core="cell0", heartbeat_s=0.5, dead_after_s=60),
        ClusterSchedulerSection(policy="colocate", params={"partial_rollouts": True, "oversample_groups": 1}))
    summary = ClusterRun(config, progress).run()
    assert summary.status == "completed" and released.is_set()
    log = summary.log

    from gyre.audit import audit

    report = audit(log, expected_steps=2)
    assert report.ok, report.problems
    assert report.executions_cut == 2 and report.max_version_lag == 1, report

    events = list(LogReader(log).events())
    assert {e.status for e in events if e.kind == "execution_finished"} == {"completed"}
    assert [(e.step, e.samples) for e in events if e.kind == "train_step_finished"] == [(0, 4), (1, 4)]
    slow = sorted({e.execution_id for e in events if e.kind == "execution_queued" and "-slow" in e.group_id})
    assert len(slow) == 2
    for execution_id in slow:
        mine = [e for e in events if getattr(e, "execution_id", None) == execution_id]
        kinds = [e.kind for e in mine]
        assert kinds.count("execution_queued") == 2 and kinds.count("execution_started") == 2, kinds
        calls = [e for e in mine if e.kind == "model_call_finished"]
        assert [c.engine_version for c in calls] == [0, 1]  # cut between its calls: the second on step 0's weights
    fold = SchedulerFold()
    for event in events:
        fold.apply(event)
    assigned = fold.view.work.assigned
    slow_group = next(e.group_id for e in events if e.kind == "execution_queued" and e.execution_id == slow[0])
    assert slow_group in assigned[1] and slow_group not in assigned[0], assigned
    replay = replay_decisions(log)
    assert replay.decisions > 0 and replay.mismatches == [], replay.to_dict()
