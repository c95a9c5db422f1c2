"""Partial rollouts: a step does not wait for its slowest groups, cut work is continued (not redone), every
group is trained exactly once and never more than staleness + 1 versions old; off, nothing changes."""

from collections import Counter

import pytest

from gyre.errors import ConfigError
from gyre.scheduler import get_policy
from gyre.sim.runner import policy_params, simulate
from gyre.sim.scenario import load_scenario, with_values
from gyre.sim.workload import sample_workload
from gyre.sink import MemorySink

PARTIAL = {"partial_rollouts": True, "oversample_groups": 2}


def tailed():
    """tiny with a stalling task in every batch: one group runs to the timeout, the others are short."""
    return with_values(load_scenario("tiny"), {"rollout.stall_task_share": 0.3, "rollout.stall_prob": 1.0,
                                               "rollout.timeout_s": 900.0, "steps": 4})


def run(scenario, policy: str, overrides: dict):
    sink = MemorySink()
    result = simulate(scenario, policy, sink=sink, workload=sample_workload(scenario, scenario.seed),
                      params=policy_params(scenario, get_policy(policy), overrides))
    return result, sink.events


def test_colocate_trains_without_waiting_for_the_stalled_group_and_cuts_the_rest():
    sc = tailed()
    whole, _ = run(sc, "colocate", {"stream_micro_steps": True})
    partial, events = run(sc, "colocate", {"stream_micro_steps": True, **PARTIAL})
    assert partial.hours < whole.hours
    assert partial.cut_executions > 0 and partial.carried_groups > 0
    aborted = [e for e in events if e.kind == "model_call_finished" and e.finish_reason == "abort"]
    assert len(aborted) == partial.cut_executions
    assert whole.cut_executions == whole.carried_groups == 0


@pytest.mark.parametrize("policy", ["elastic", "colocate", "async"])
def test_every_group_is_trained_once_by_a_full_step_and_within_staleness_plus_one(policy):
    sc = tailed()
    overrides = {"stream_micro_steps": True, **PARTIAL} | ({} if policy == "colocate" else {"staleness": 1})
    result, events = run(sc, policy, overrides)
    groups = {e.group_id for e in events if e.kind == "execution_queued"}
    starts = [e for e in events if e.kind == "train_step_started"]
    assert [e.step for e in starts] == list(range(sc.steps))
    assert all(e.groups == sc.batch.groups for e in starts)
    claims = Counter(e.step for e in events if e.kind == "micro_step_claimed")
    assert all(n == sc.batch.groups * sc.batch.micro_steps_per_group for n in claims.values())
    assert len(groups) == sc.steps * sc.batch.groups
    assert result.max_group_lag <= result.staleness + 1
    assert result.hours >= result.lower_bound_hours


def test_a_cut_execution_continues_where_it_stopped():
    """Without the decode curve an execution's time on cells equals its sampled duration, cut or not."""
    sc = tailed()
    result, events = run(sc, "colocate", {"stream_micro_steps": True, **PARTIAL})
    spec = {e.execution_id: e for e in sample_workload(sc, sc.seed).executions()}
    on_cell: dict[str, float] = Counter()
    since: dict[str, float] = {}
    cut = set()
    for e in events:
        t = e.ts.timestamp()
        if e.kind == "execution_started":
            since[e.execution_id] = t
        elif e.kind == "execution_queued" and e.execution_id in since:
            on_cell[e.execution_id] += t - since.pop(e.execution_id)
            cut.add(e.execution_id)
        elif e.kind == "execution_finished":
            on_cell[e.execution_id] += t - since.pop(e.execution_id)
    assert cut and len(cut) <= result.cut_executions
    for execution in cut:
        assert on_cell[execution] == pytest.approx(spec[execution].duration_s, abs=0.01)


def test_over_sampling_needs_partial_rollouts_and_at_most_half_a_batch():
    with pytest.raises(ConfigError, match="needs partial_rollouts"):
        with_values(load_scenario("tiny"), {"policy.async": {"oversample_groups": 1}})
    over = load_scenario("tiny").batch.groups + 1
    with pytest.raises(ConfigError, match="at most a batch"):
        with_values(load_scenario("tiny"), {"policy.async": {"partial_rollouts": True, "oversample_groups": over}})


def test_off_by_default_and_off_changes_nothing():
    sc = load_scenario("tiny")
    for name in ("elastic", "colocate", "async"):
        assert not policy_params(sc, get_policy(name)).partial_rollouts
    default, events = run(sc, "colocate", {})
    explicit, _ = run(sc, "colocate", {"partial_rollouts": False, "oversample_groups": 0})
    assert default.hours == explicit.hours and default.cut_executions == 0
    assert not any(e.kind == "model_call_finished" and e.finish_reason == "abort" for e in events)


def test_a_partial_rollouts_log_replays_exactly_and_reads_back(tmp_path):
    """The cuts and the step assignment are folds of the log: replay re-decides every colocate switch
    (which reads the assignment) identically, and busy time read with DuckDB matches the summary."""
    from gyre.log import LogReader
    from gyre.replay.exact import replay_decisions
    from gyre.sim.metrics import log_busy

    sc = tailed()
    params = policy_params(sc, get_policy("colocate"), {"stream_micro_steps": True, **PARTIAL})
    result = simulate(sc, "colocate", params=params, log_dir=tmp_path / "log")
    assert result.cut_executions > 0
    report = replay_decisions(tmp_path / "log")
    assert report.decision_points > 0 and not report.mismatches
    busy = log_busy(LogReader(tmp_path / "log").duckdb())
    assert busy.utilization == pytest.approx(result.utilization, abs=1e-6)
