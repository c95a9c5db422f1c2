"""elastic/3 live: chosen by the config's ``scheduler.version``, recorded in ``run_started``, replayed exactly
under it; the same log replayed as elastic/2 tells the versions apart (so these replays can fail).

- Three cells, as `test_cluster_run` (one model call per execution, a micro-step per execution): elastic/3
  under its parameter rule (``spread_tail`` on) lends and recalls cells; the run completes and audits clean.
- One cell with partial rollouts and one over-sampled group, ordered by files as `test_cluster_partial`: once
  step 0's own groups are complete the over-sampled group's two executions are work the step does not need,
  so elastic/3 sends the cell to training and cuts them (elastic/2 weighs the whole watermark and would keep
  the cell in rollout until they finish). They resume on the new weights and step 1 trains them. While step
  0's groups are scored (their harnesses ended: no demand, no complete group yet) the cell stays where it is:
  before ``idle_demand`` it flapped between the roles, cutting the slow ones again.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.audit import audit
from gyre.cluster.config import ClusterSchedulerSection, ClusterSection
from gyre.cluster.run import ClusterRun
from gyre.log import LogReader
from gyre.replay.exact import replay_decisions
from tests.cluster.test_cluster_partial import held_run
from tests.cluster.test_cluster_run import cluster_config

pytestmark = pytest.mark.integration


def _started(log: Path) -> dict:
    start = next(iter(LogReader(log).events(kinds=["run_started"])))
    return {"version": start.policy_version, "params": json.loads(start.policy_params)}


def test_elastic3_runs_live_and_its_log_replays_under_it(tmp_path: Path) -> None:
    base = cluster_config(tmp_path / "run")
    config = base.model_copy(update={"scheduler": ClusterSchedulerSection(
        policy="elastic", version="elastic/3", params={"hysteresis_slots": 0})})
    summary = ClusterRun(config).run()
    assert summary.status == "completed" and summary.policy == "elastic/3"
    log = summary.log
    started = _started(log)
    assert started["version"] == "elastic/3"
    assert started["params"]["spread_tail"] and not started["params"]["backlog_loans"]  # the parameter rule
    report = audit(log, expected_steps=2, replay=True)
    assert report.ok, report.problems
    replay = replay_decisions(log)
    assert replay.current_version == "elastic/3" and replay.decisions > 0 and replay.mismatches == []
    assert any(s.to_role == "training" for s in LogReader(log).events(kinds=["role_switch_requested"]))
    as_v2 = replay_decisions(log, version="elastic/2")
    assert as_v2.current_version == "elastic/2" and as_v2.mismatches  # the versions differ on this log


def test_elastic3_cuts_the_work_the_next_step_does_not_need(tmp_path: Path) -> None:
    config, released, progress = held_run(
        tmp_path, "elastic3-partial", ClusterSection(cells=1, slots=6, core="cell0", heartbeat_s=0.5, dead_after_s=60),
        ClusterSchedulerSection(policy="elastic", version="elastic/3", params={
            "partial_rollouts": True, "oversample_groups": 1, "hysteresis_slots": 0}))
    summary = ClusterRun(config, progress).run()
    assert summary.status == "completed" and released.is_set()
    log = summary.log
    started = _started(log)
    assert started["params"]["backlog_loans"] and started["params"]["idle_recall"]  # the rule with partial rollouts
    assert not started["params"]["stream_micro_steps"]  # live, a partial step starts once full: recorded so
    report = audit(log, expected_steps=2, replay=True)
    assert report.ok, report.problems
    assert report.executions_cut == 2 and report.max_version_lag == 1, report

    events = list(LogReader(log).events())
    assert [(e.step, e.samples) for e in events if e.kind == "train_step_finished"] == [(0, 4), (1, 4)]
    switches = [e.to_role for e in events if e.kind == "role_switch_requested"]
    assert switches == ["training", "rollout", "training"], switches  # no flapping while step 0 is scored
    first = next(e for e in events if e.kind == "role_switch_requested" and e.to_role == "training")
    assert "next step's 0 executions" in first.reason and not first.redirects  # nothing needed: all of it cut
    slow = {e.execution_id for e in events if e.kind == "execution_queued" and "-slow" in e.group_id}
    again = [e.execution_id for e in events if e.kind == "execution_queued" and e.execution_id in slow]
    assert len(slow) == 2 and all(again.count(e) == 2 for e in slow)  # each queued again once: the cut

    replay = replay_decisions(log)
    assert replay.decisions > 0 and replay.mismatches == [], replay.to_dict()
    as_v2 = replay_decisions(log, version="elastic/2")
    at_first = next(m for m in as_v2.mismatches if m.seq == first.seq)
    assert at_first.replayed == []  # elastic/2 keeps the cell in rollout: its watermark counts the cut work
