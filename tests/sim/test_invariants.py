"""Simulator invariants, checked on the event stream every policy produces on a tiny scenario."""

from collections import Counter

import pytest

from gyre.scheduler import get_policy
from gyre.sim.runner import policy_params, simulate
from gyre.sim.scenario import load_scenario, with_values
from gyre.sink import MemorySink

CASES = [("elastic", 0, False), ("elastic", 1, False), ("colocate", 0, False), ("async", 0, False),
         ("async", 1, False), ("elastic", 0, True), ("elastic", 1, True), ("colocate", 0, True), ("async", 1, True),
         ("elastic", 0, False, True), ("elastic", 1, True, True), ("colocate", 0, False, True),
         ("colocate", 0, True, True), ("async", 0, False, True), ("async", 1, True, True),
         ("elastic", 0, True, False, True), ("elastic", 1, True, True, True), ("colocate", 0, True, True, True),
         ("async", 1, True, True, True)]
"""(policy, staleness, every cost on, partial rollouts with one group over-sampled, per-call workloads)"""
MECHANISMS = {
    "decode.share": 0.6, "decode.step_ms": 5.0, "decode.per_request_ms": 1.0, "decode.per_mtoken_ms": 20.0,
    "rollout.kv_cell_gb_per_s": 2.0, "training.gradient_sync_s": 7.0, "training.share_core_link": True,
    "training.reference_gpus": 16, "policy.colocate": {"stream_micro_steps": True},
    "policy.async": {"stream_micro_steps": True, "training_cells": 1},
}
"""Every load- and layout-dependent cost switched on, streaming for every policy."""
PER_CALL = {"calls.simulate": True, "calls.s_per_call": 20.0, "calls.compact_at_tokens": 20_000,
            "calls.summary_tokens": 4_000, "calls.prefill_s_per_mtoken": 50.0, "rollout.resume_s_per_mtoken": 50.0}
"""Executions run call by call (about a dozen calls each), with compactions, prefill and re-prefill."""


def run(policy: str, staleness: int, seed: int = 0, steps: int | None = None, mechanisms: bool = False,
        partial: bool = False, per_call: bool = False):
    scenario = load_scenario("tiny")
    if mechanisms:
        scenario = with_values(scenario, MECHANISMS)
    if per_call:
        scenario = with_values(scenario, PER_CALL)
    overrides: dict = {} if policy == "colocate" else {"staleness": staleness}
    if partial:
        overrides.update(partial_rollouts=True, oversample_groups=1)
    sink = MemorySink()
    result = simulate(scenario, policy, seed=seed, steps=steps, sink=sink,
                      params=policy_params(scenario, get_policy(policy), overrides))
    return scenario, result, sink.events


@pytest.fixture(scope="module", params=CASES,
                ids=[f"{c[0]}-k{c[1]}{'-costs' if c[2] else ''}{'-partial' if c[3:4] == (True,) else ''}"
                     f"{'-calls' if c[4:] else ''}" for c in CASES])
def simulated(request):
    policy, staleness, mechanisms, *rest = request.param  # (keyword: the costs cases once ran as seed 1)
    partial, per_call = (bool(rest[0]) if rest else False), (bool(rest[1]) if rest[1:] else False)
    return run(policy, staleness, mechanisms=mechanisms, partial=partial, per_call=per_call)


def test_time_never_goes_back(simulated):
    _, _, events = simulated
    stamps = [e.ts for e in events]
    assert all(t is not None for t in stamps) and stamps == sorted(stamps)
    assert events[0].kind == "run_started" and events[-1].kind == "run_finished"


def test_roles_are_exclusive_and_work_lands_only_on_settled_cells(simulated):
    scenario, _, events = simulated
    role: dict[str, str] = {}
    switching: dict[str, str | None] = {}
    load: Counter[str] = Counter()
    where: dict[str, str] = {}
    for e in events:
        if e.kind == "cell_registered":
            role[e.cell_id], switching[e.cell_id] = e.role, None
        elif e.kind == "role_switch_requested":
            assert switching[e.cell_id] is None and role[e.cell_id] == e.from_role != e.to_role
            switching[e.cell_id] = e.to_role
        elif e.kind == "role_switch_completed":
            assert switching[e.cell_id] == e.to_role
            role[e.cell_id], switching[e.cell_id] = e.to_role, None
        elif e.kind == "execution_queued" and e.execution_id in where:  # cut: it holds no slot until resumed
            load[where.pop(e.execution_id)] -= 1
        elif e.kind in ("execution_started", "call_redirected"):
            cell = e.cell_id if e.kind == "execution_started" else e.to_cell_id
            assert role[cell] == "rollout" and switching[cell] is None, e
            if e.kind == "call_redirected":
                load[where[e.execution_id]] -= 1
            where[e.execution_id] = cell
            load[cell] += 1
            assert load[cell] <= scenario.cluster.slots_per_cell
        elif e.kind == "model_call_started":
            assert e.cell_id == where[e.execution_id]
        elif e.kind == "execution_finished":
            load[where.pop(e.execution_id)] -= 1
        elif e.kind == "micro_step_claimed":
            assert role[e.cell_id] == "training" and switching[e.cell_id] is None, e
    assert not where and all(v == 0 for v in load.values())


def test_every_execution_runs_finishes_and_is_judged_once(simulated):
    _, result, events = simulated
    kinds = Counter(e.kind for e in events)
    for kind in ("execution_queued", "execution_started", "execution_finished"):
        ids = [e.execution_id for e in events if e.kind == kind]
        again = result.cut_executions if kind != "execution_finished" else 0  # a cut one is queued again
        assert len(set(ids)) == result.executions and len(ids) == result.executions + again
    judged = [e.execution_id for e in events if e.kind in ("reward_recorded", "evaluation_failed")]
    crashed = [e.execution_id for e in events if e.kind == "execution_finished" and e.status == "harness_error"]
    assert len(judged) == len(set(judged)) and set(judged).isdisjoint(crashed)
    assert len(judged) + len(crashed) == result.executions
    assert kinds["train_step_finished"] == kinds["weights_published"] == result.steps


def test_micro_steps_are_claimed_and_finished_once_in_order(simulated):
    _, result, events = simulated
    claims = [(e.step, e.micro_step) for e in events if e.kind == "micro_step_claimed"]
    assert len(claims) == len(set(claims))
    assert sorted(claims) == sorted((e.step, e.micro_step) for e in events if e.kind == "micro_step_finished")
    steps = [e.step for e in events if e.kind == "train_step_started"]
    assert steps == list(range(result.steps))


def test_batches_respect_the_staleness_bound(simulated):
    """Batch s is queued at version s - staleness or later; with partial rollouts the over-sampled groups
    come one version earlier, and no trained group's oldest tokens are more than staleness + 1 behind."""
    _, result, events = simulated
    version: dict[str, int] = {}
    for e in events:
        if e.kind == "execution_queued":
            version.setdefault(e.execution_id, e.policy_version)  # a cut execution keeps its first queueing
    step = {e.execution_id: e.step for e in events if e.kind == "execution_queued"}
    early = 1 if result.partial_rollouts else 0
    for execution, s in step.items():
        assert version[execution] >= s - result.staleness - early
    assert max(s - version[e] for e, s in step.items()) == result.staleness + early
    assert result.max_group_lag <= result.staleness + early


def test_no_policy_beats_the_lower_bound(simulated):
    _, result, _ = simulated
    assert result.hours >= result.lower_bound_hours
    assert 0 < result.utilization <= 1


def test_same_seed_same_log_other_seed_other_log():
    first = [e.model_dump() for e in run("elastic", 0)[2]]
    assert first == [e.model_dump() for e in run("elastic", 0)[2]]
    assert first != [e.model_dump() for e in run("elastic", 0, seed=1)[2]]


def test_fewer_steps_keep_the_same_first_steps():
    short, long = run("colocate", 0, steps=2)[2], run("colocate", 0, steps=3)[2]
    durations = {e.execution_id: e.duration_s for e in long if e.kind == "execution_finished"}
    assert all(durations[e.execution_id] == e.duration_s for e in short if e.kind == "execution_finished")
