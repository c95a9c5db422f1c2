"""Per-call workloads: a plan keeps its execution's aggregate, is pure and serialisable, and the simulator
times it call by call (waits + prefill + decode at the curve's speed, the timeout)."""

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.errors import ConfigError
from gyre.scheduler import get_policy
from gyre.sim.calls import CallPlan, CallTiming, describe_workload, plan_calls
from gyre.sim.describe import main as describe_main
from gyre.sim.runner import policy_params, simulate
from gyre.sim.scenario import load_scenario, with_values
from gyre.sim.workload import ExecutionSpec, Workload, sample_workload
from gyre.sink import MemorySink

ALONE = {"cluster.cells": 2, "batch.groups": 1, "batch.group_size": 1, "decode.share": 0.5,
         "decode.step_ms": 5.0, "decode.per_request_ms": 1.0, "decode.per_mtoken_ms": 20.0,
         "calls.simulate": True, "calls.s_per_call": 20.0, "calls.compact_at_tokens": 20_000,
         "calls.summary_tokens": 4_000, "calls.prefill_s_per_mtoken": 50.0}
"""``tiny`` as two cells serving one batch, with a decode curve and per-call timing on."""


def spec(duration: float, tokens: int, status: str = "completed", calls: int = 3, name: str = "s000-g000-r00",
         step: int = 0) -> ExecutionSpec:
    return ExecutionSpec(execution_id=name, task_id="t", group_id=name[:9], step=step, duration_s=duration,
                         status=status, calls=calls, tokens=tokens, eval_s=5.0, eval_failed=False, reward=0.5)


def test_defaults_keep_the_aggregate_execution():
    """Same calls as the aggregate model, same tokens, and its duration at the reference decode speed."""
    sc = load_scenario("seed-2.4t")
    timing = CallTiming(sc)
    for e in sample_workload(sc, 0, 1).executions():
        plan = plan_calls(sc, e, 0, timing)
        stall = e.status == "timed_out"
        assert len(plan.calls) == e.calls + stall and plan.crash == (e.status == "harness_error")
        assert sum(c.prompt_delta_tokens + c.output_tokens for c in plan.calls) == e.tokens + stall
        work = replace(plan, calls=plan.calls[:len(plan.calls) - stall])
        assert timing.reference_s(work) == pytest.approx(e.duration_s, abs=0.01)
        assert not any(c.compaction for c in plan.calls)
        assert plan.calls[-1].stall == stall and (not stall or plan.calls[-1].wait_s == sc.rollout.timeout_s)


def test_a_plan_is_pure_and_its_description_round_trips():
    sc = with_values(load_scenario("terminal-bench-like"), {"calls.s_per_call": 5.0, "calls.compact_at_tokens": 8000})
    e = sample_workload(sc, 3, 1).executions()[7]
    plan = plan_calls(sc, e, 3)
    assert plan == plan_calls(sc, e, 3) and plan != plan_calls(sc, e, 4)
    text = json.dumps(plan.to_json(time_scale=100, token_scale=50))
    back = json.loads(text)
    assert CallPlan.from_json(back) == plan and back["time_scale"] == 100 and back["token_scale"] == 50
    assert (back["group"], back["rollout"]) == (0, 7) and back["totals"]["calls"] == len(plan.calls)
    assert back["totals"]["compactions"] > 0
    whole = describe_workload(sc, Workload((sample_workload(sc, 3, 1).batches[0][:4],)), 3)
    assert [d["execution_id"] for d in whole["executions"]] == [f"s000-g000-r{i:02d}" for i in range(4)]


@settings(max_examples=60, deadline=None)
@given(duration=st.floats(5, 5000), per_s=st.floats(1, 800), calls=st.integers(1, 12),
       status=st.sampled_from(["completed", "timed_out", "harness_error"]), seed=st.integers(0, 2**16),
       s_per_call=st.one_of(st.none(), st.floats(1, 600)), sigma=st.floats(0, 2),
       compact_at=st.one_of(st.none(), st.integers(5_000, 400_000)))
def test_plans_conserve_tokens_and_bound_their_context(duration, per_s, calls, status, seed, s_per_call, sigma,
                                                      compact_at):
    sc = with_values(load_scenario("terminal-bench-like"), {"calls.s_per_call": s_per_call, "calls.call_sigma": sigma,
                                                            "calls.compact_at_tokens": compact_at})
    tokens = int(per_s * duration)
    plan = plan_calls(sc, spec(duration, tokens, status, calls), seed)
    stall = status == "timed_out"
    summaries = sum(c.compaction for c in plan.calls) * sc.calls.summary_tokens
    assert sum(c.prompt_delta_tokens + c.output_tokens for c in plan.calls) == \
        max(tokens, len(plan.calls) - stall) + summaries + stall
    assert all(c.wait_s >= 0 and c.prompt_delta_tokens >= 0 and c.output_tokens >= 1 for c in plan.calls)
    assert [c.stall for c in plan.calls] == [False] * (len(plan.calls) - stall) + [True] * stall
    for i, (c, context) in enumerate(zip(plan.calls, plan.contexts, strict=True)):
        if compact_at is not None and i > 0 and not c.compaction:  # only a root's first call may exceed it
            assert context <= compact_at
    assert json.loads(json.dumps(plan.to_json())) == plan.to_json()


def run_alone(*executions: ExecutionSpec, values: dict | None = None, policy: str = "colocate"):
    sc = with_values(load_scenario("tiny"), {**ALONE, **(values or {})})
    sink = MemorySink()
    workload = Workload((executions,))
    simulate(sc, policy, seed=0, workload=workload, sink=sink,
             params=policy_params(sc, get_policy(policy), {}))
    return sc, sink.events


def durations(events) -> dict[str, tuple[float, str]]:
    return {e.execution_id: (e.duration_s, e.status) for e in events if e.kind == "execution_finished"}


def test_alone_an_execution_takes_its_waits_prefill_and_decode():
    """No contention: duration = sum over calls of wait + prefill + output x t(1, context)."""
    e = spec(300, 60_000, calls=4)
    sc, events = run_alone(e)
    plan, timing = plan_calls(sc, e, 0), CallTiming(sc)
    assert len(plan.calls) == 15 and any(c.compaction for c in plan.calls)
    took, status = durations(events)[e.execution_id]
    assert status == "completed"
    assert took == pytest.approx(timing.alone_s(plan), abs=3e-6 * len(plan.calls))
    assert took < e.duration_s  # alone it decodes faster than on the reference (full) cell
    started = [x for x in events if x.kind == "model_call_started"]
    assert [x.prompt_tokens for x in started] == [plan.prompt_tokens(i) for i in range(len(plan.calls))]
    roots = [x.parent_call_id is None for x in started]
    assert roots[0] and not any(roots[1:])  # one chain of calls (compaction roots are the harness's to mark)


def test_contention_only_slows_an_execution_and_the_timeout_cuts_it():
    a, b = spec(300, 60_000, calls=4, name="s000-g000-r00"), spec(300, 60_000, calls=4, name="s000-g000-r01")
    sc, events = run_alone(a, b, values={"batch.group_size": 2})
    timing = CallTiming(sc)
    for e in (a, b):
        assert durations(events)[e.execution_id][0] >= timing.alone_s(plan_calls(sc, e, 0)) - 1e-5
    long = spec(900, 60_000, calls=4)  # sampled as completed, but longer than the timeout on this cell
    sc, events = run_alone(long, values={"rollout.timeout_s": 200, "rollout.median_s": 100})
    assert durations(events)[long.execution_id] == (200.0, "timed_out")
    aborted = [x for x in events if x.kind == "model_call_finished" and x.finish_reason == "abort"]
    assert len(aborted) == 1
    stalled = spec(900, 60_000, status="timed_out", calls=4)  # a stall: it times out whatever the load
    sc, events = run_alone(stalled)
    assert durations(events)[stalled.execution_id] == (sc.rollout.timeout_s, "timed_out")


def test_per_call_runs_are_deterministic_and_off_by_default():
    sc = load_scenario("terminal-bench-like")
    assert not sc.calls.simulate
    on = with_values(sc, {"calls.simulate": True})
    first, second = simulate(on, "elastic", steps=2), simulate(on, "elastic", steps=2)
    assert first == second
    assert first.hours == pytest.approx(simulate(sc, "elastic", steps=2).hours, rel=0.1)


def test_per_call_needs_a_decode_curve():
    with pytest.raises(ConfigError, match=r"calls\.simulate needs decode\.share"):
        with_values(load_scenario("tiny"), {"calls.simulate": True})


def test_describe_writes_a_workloads_descriptions(tmp_path, capsys):
    out = tmp_path / "workload.json"
    assert describe_main(["terminal-bench-like-scaled", "--steps", "1", "--token-scale", "50", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["format"] == "gyre-workload-set/1" and len(document["executions"]) == 64
    assert {d["token_scale"] for d in document["executions"]} == {50}
    assert describe_main(["tiny"]) == 2 and "no decode curve" in capsys.readouterr().err
