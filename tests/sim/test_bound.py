"""The lower bound on hand-made workloads: the work term and the critical path, by arithmetic."""

import pytest

from gyre.sim.bound import lower_bound
from gyre.sim.scenario import load_scenario
from gyre.sim.workload import ExecutionSpec, Workload


def spec(step: int, group: str, duration: float, tokens: int, eval_s: float = 10.0) -> ExecutionSpec:
    return ExecutionSpec(execution_id=f"{group}-{duration}", task_id=group, group_id=group, step=step,
                         duration_s=duration, status="completed", calls=1, tokens=tokens, eval_s=eval_s,
                         eval_failed=False, reward=0.5)


def test_critical_path_is_slowest_run_plus_evaluation_plus_last_micro_step():
    sc = load_scenario("tiny")  # 3 cells x 8 slots, 400 s per Mtoken, 2 micro-steps per group
    t = sc.training
    batch = (spec(0, "a", 100, 1_000_000), spec(0, "a", 500, 1_000_000), spec(0, "b", 50, 500_000))
    bound = lower_bound(sc, Workload((batch,)), staleness=0)
    cheapest_micro = 0.5 * 400 / sc.batch.micro_steps_per_group  # group b: 0.5 Mtoken in 2 micro-steps
    assert bound.critical_path_s == pytest.approx(500 + 10 + cheapest_micro + t.optimizer_s + t.publish_s)
    work = (650 / 8 + 2.5 * 400 + t.optimizer_s) / 3
    assert bound.work_s == pytest.approx(work)
    assert bound.seconds == max(bound.work_s, bound.critical_path_s)


def test_staleness_lets_batches_overlap_on_the_critical_path():
    sc = load_scenario("tiny")
    batches = tuple((spec(s, f"s{s}", 300, 100_000),) for s in range(3))
    serial = lower_bound(sc, Workload(batches), staleness=0).critical_path_s
    overlapped = lower_bound(sc, Workload(batches), staleness=1).critical_path_s
    assert overlapped < serial
