"""A cluster run with `[evaluation]` and `[observe]`: the run host evaluates held-out tasks on the cells
that hold the version to evaluate, exporters follow the log, and the report is written — as `gyre train`.

Two cells, one step: held-out evaluations of the initial policy (before any step can take a cell) and of
the final one (the loop holds until it is recorded; the policy serves the held-out work as any other).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre.audit import audit
from gyre.cluster.config import ClusterSection
from gyre.cluster.run import ClusterRun
from gyre.config import EvaluationSection, ObserveSection
from gyre.log import LogReader
from tests.cluster.test_cluster_run import QUICK, cluster_config

pytestmark = pytest.mark.integration


def test_a_cluster_run_evaluates_held_out_tasks_and_exports(tmp_path: Path) -> None:
    base = cluster_config(tmp_path / "run", steps=1)
    config = base.model_copy(update={
        "cluster": ClusterSection(cells=2, slots=2, core="cell0", heartbeat_s=0.5, dead_after_s=60),
        # the quick set's one task, held out as its own set: what a run evaluates need not be what it trains
        "evaluation": EvaluationSection(every=1, tasks=QUICK / "tasks.toml", task_ids=("hello",), samples=2),
        "observe": ObserveSection(exporters=["tensorboard"], report=True),
    })
    seen: list[str] = []
    summary = ClusterRun(config, lambda phase, figures: seen.append(phase)).run()
    assert summary.status == "completed" and [s.step for s in summary.steps] == [0]
    assert seen.count("heldout") == 2 and "report" in seen

    con = LogReader(summary.log).duckdb()
    heldout = con.execute("SELECT step, policy_version, executions, scored FROM heldout_evaluations "
                          "ORDER BY seq").fetchall()
    assert heldout == [(0, 0, 2, 2), (1, 1, 2, 2)]
    # each held-out execution was queued outside the steps, with the version evaluated, and every call it
    # made ran on weights at least that new
    rows = con.execute("SELECT q.execution_id, q.step, q.policy_version, min(c.engine_version) FROM "
                       "executions_queued q JOIN model_calls c USING (execution_id) "
                       "WHERE q.group_id LIKE 'heldout-%' GROUP BY ALL").fetchall()
    assert len(rows) == 4
    assert all(step is None and served >= version for _, step, version, served in rows), rows
    trained = con.execute("SELECT samples FROM train_steps").fetchall()
    # the step consumed exactly the training groups' executions: held-out executions are never trained on
    assert trained == [(base.rollout.groups_per_step * base.rollout.group_size,)]
    assert audit(summary.log, expected_steps=1).ok

    assert list((config.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert (config.run_dir / "report.html").stat().st_size > 10_000
