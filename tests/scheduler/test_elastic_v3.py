"""elastic/3: capacity against the work the next step needs; with partial rollouts a leaving cell redirects
only that work and cuts the rest (progress kept); replay of its logs is exact; its parameters are validated."""

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gyre.errors import ConfigError
from gyre.scheduler import ELASTIC, ELASTIC3_MECHANISMS, ELASTIC3_PARTIAL_MECHANISMS, ELASTIC_V3, get_policy
from gyre.scheduler.elastic import Needs
from gyre.sim.engine import Simulation
from gyre.sim.runner import elastic3_variants, policy_params, scenario_values, simulate, summarise
from gyre.sim.scenario import load_scenario, with_values
from gyre.sim.workload import sample_workload
from gyre.sink import MemorySink, NullSink


def tailed(**values):
    """tiny with a stalling task in every batch (a tail to lend around) and the decode curve off."""
    return with_values(load_scenario("tiny"), {"rollout.stall_task_share": 0.3, "rollout.stall_prob": 1.0,
                                               "rollout.timeout_s": 900.0, "steps": 4, **values})


def test_elastic3_is_shipped_beside_elastic2_which_stays_the_default():
    assert get_policy("elastic", "elastic/3") is ELASTIC_V3
    assert get_policy("elastic") is ELASTIC and ELASTIC.version == "elastic/2"
    params = ELASTIC_V3.params({"cut_unneeded": False, "staleness": 1})
    assert params.rate_split and not params.cut_unneeded
    with pytest.raises(ConfigError, match="rate_split"):
        ELASTIC_V3.params({"rate_split": "sometimes"})
    with pytest.raises(ConfigError):
        ELASTIC_V3.params({"split_cells": 2})  # no per-scenario knob: the split is derived (docs/scheduler.md)


class Checked:
    """elastic/3 that checks each decision against the view it was made on."""

    def __init__(self) -> None:
        self.leaves = 0
        self.cut_calls = 0
        self.idle_recalls = 0

    def __call__(self, view, params):
        decisions = ELASTIC_V3.decide(view, params)
        needs = Needs.of(view)
        current = view.trainer.current
        ready = view.work.ready_micro_steps(len(current.claimed) if current is not None and not current.closed else 0)
        gone = {d.cell_id for d in decisions if d.to_role == "training"}
        staying = [c for c in view.cells_in("rollout") if c.cell_id not in gone]
        if gone and params.spread_tail and not params.staleness and needs.demand:
            spare = view.capacity(staying) - needs.demand
            assert spare >= max(params.hysteresis_slots, max(c.slots for c in view.cells_in("rollout")) // 2)
        for d in decisions:
            if d.reason.startswith("idle in training"):
                self.idle_recalls += 1
                assert params.partial_rollouts and params.idle_recall
                assert view.cluster.queued and not ready and d.cell_id not in view.busy_training()
                assert not view.cluster.cells[d.cell_id].is_core
            leaving_satellite = not view.cluster.cells[d.cell_id].is_core and d.to_role == "training"
            no_floor = not (params.staleness and params.rate_split)
            if leaving_satellite and params.partial_rollouts and params.backlog_loans and no_floor and \
                    view.work.mean("micro_step") is not None:
                assert ready > 0, "a satellite was lent with no micro-step ready to claim"
            if d.to_role != "training" or d.from_role != "rollout":
                continue
            self.leaves += 1
            moved = {r.execution_id for r in d.redirects}
            here = {view.work.call_execution[c] for c in view.cluster.inflight(d.cell_id)}
            assert needs.running & here <= moved, "a needed execution was left on a leaving cell"
            if not (params.partial_rollouts and params.cut_unneeded):
                assert here <= moved, "without cuts every execution is redirected"
            self.cut_calls += len(here - moved)
        return decisions


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 50), staleness=st.integers(0, 1), oversample=st.integers(0, 2),
       partial=st.booleans(), cut=st.booleans(), backlog=st.booleans())
def test_a_leaving_cell_never_leaves_needed_work_unredirected(seed, staleness, oversample, partial, cut, backlog):
    sc = tailed(**{"rollout.resume_s_per_mtoken": 20.0})
    overrides = {"staleness": staleness, "cut_unneeded": cut, "partial_rollouts": partial,
                 "oversample_groups": oversample if partial else 0, "backlog_loans": backlog, "idle_recall": backlog,
                 "spread_tail": backlog}
    params = policy_params(sc, ELASTIC_V3, overrides)
    checked = Checked()
    sim = Simulation(sc, sample_workload(sc, seed), replace(ELASTIC_V3, decide=checked), params, NullSink(),
                     seed=seed, run_id="checked")
    result = summarise(sim, sim.run(), None)
    assert checked.leaves > 0
    assert result.max_group_lag <= staleness + 1 and result.max_token_lag <= staleness + 1
    if not partial:
        assert result.cut_executions == 0 and checked.cut_calls == 0
    assert checked.cut_calls <= result.cut_executions


def test_cuts_keep_progress_and_resuming_pays_the_re_prefill():
    """Decode curve off: an execution's time on cells is its sampled duration plus, per resumption, its
    context's re-prefill (``rollout.resume_s_per_mtoken``); cut work is never redone."""
    sc = tailed(**{"rollout.resume_s_per_mtoken": 50.0})
    sink = MemorySink()
    params = policy_params(sc, ELASTIC_V3, {"partial_rollouts": True, "oversample_groups": 2})
    result = simulate(sc, "elastic", sink=sink, params=params, version="elastic/3")
    assert result.cut_executions > 0 and result.resume_hours > 0
    spec = {e.execution_id: e for e in sample_workload(sc, sc.seed).executions()}
    on_cell: dict[str, float] = {}
    since: dict[str, float] = {}
    resumes: dict[str, dict[str, int]] = {}
    """Execution -> resumption suffix -> the call it resumed with."""
    t0 = sink.events[0].ts
    for e in sink.events:
        t = (e.ts - t0).total_seconds()
        if e.kind == "execution_started":
            since[e.execution_id] = t
        elif (e.kind == "execution_queued" and e.execution_id in since) or e.kind == "execution_finished":
            on_cell[e.execution_id] = on_cell.get(e.execution_id, 0.0) + t - since.pop(e.execution_id)
        elif e.kind == "model_call_started" and "-r" in e.call_id.rsplit("-c", 1)[-1]:
            call, suffix = e.call_id.rsplit("-c", 1)[-1].split("-r")
            resumes.setdefault(e.execution_id, {}).setdefault(suffix, int(call))
    assert resumes
    total_pause, exact = 0.0, 0
    for execution, calls in resumes.items():
        s = spec[execution]  # the resumed call's context: the trajectory grows evenly over the calls
        pause = sum(s.tokens * (call + 1) // s.calls / 1e6 * 50.0 for call in calls.values())
        total_pause += pause
        exact += on_cell[execution] == pytest.approx(s.duration_s + pause, abs=0.01 * len(calls) + 0.01)
        # never less than its work (progress kept); less than the full charge only when cut mid-re-prefill
        assert s.duration_s - 0.01 <= on_cell[execution] <= s.duration_s + pause + 0.01 * len(calls) + 0.01
    assert exact > 0
    assert total_pause / 3600 == pytest.approx(result.resume_hours, rel=0.05)


def test_an_elastic3_log_replays_exactly(tmp_path):
    from gyre.replay.exact import replay_decisions

    sc = tailed(**{"rollout.resume_s_per_mtoken": 20.0})
    params = policy_params(sc, ELASTIC_V3, {"partial_rollouts": True, "oversample_groups": 2, "staleness": 1,
                                            "backlog_loans": True, "idle_recall": True})
    result = simulate(sc, "elastic", params=params, version="elastic/3", log_dir=tmp_path / "log")
    assert result.policy_version == "elastic/3" and result.role_switches > 0
    report = replay_decisions(tmp_path / "log")
    assert report.decision_points > 0 and not report.mismatches
    assert report.recorded_version == report.current_version == "elastic/3"
    # the same prefixes decided by elastic/2 (the parameters it takes): the log tells the versions apart
    as_v2 = replay_decisions(tmp_path / "log", version="elastic/2")
    assert as_v2.mismatches and (as_v2.recorded_version, as_v2.current_version) == ("elastic/3", "elastic/2")


def test_the_parameter_rule_is_the_ablations_and_a_config_overrides_it():
    """A run that leaves elastic/3's mechanisms unset (live from a config, `gyre sim --policy-version`) runs
    the ablation's elastic/3 rows: spread_tail on, with partial rollouts backlog_loans and idle_recall too;
    what the values set wins; the model's defaults (what older logs recorded) are unchanged; elastic/2 has
    no rule."""
    sc = tailed()
    rows = {v.name: v.overrides for v in elastic3_variants(sc)}
    assert ELASTIC_V3.run_params(scenario_values(sc, ELASTIC_V3)) == policy_params(sc, ELASTIC_V3, rows["elastic/3"])
    partial = {"partial_rollouts": True, "oversample_groups": 2}
    row = rows["elastic/3 + partial rollouts (2 over-sampled)"]
    assert ELASTIC_V3.run_params(scenario_values(sc, ELASTIC_V3, partial)) == policy_params(sc, ELASTIC_V3, row)
    on = ELASTIC_V3.run_params(partial)
    assert on.spread_tail and on.backlog_loans and on.idle_recall and on.cut_unneeded and on.rate_split
    assert set(ELASTIC3_PARTIAL_MECHANISMS) == {"spread_tail", "idle_demand", "backlog_loans", "idle_recall"}
    assert not ELASTIC_V3.run_params({}).backlog_loans and ELASTIC_V3.run_params({}).spread_tail
    assert not ELASTIC_V3.run_params({"spread_tail": False}).spread_tail
    assert not any(getattr(ELASTIC_V3.params({}), key) for key in ELASTIC3_PARTIAL_MECHANISMS)
    assert ELASTIC.run_params({"hysteresis_slots": 1}) == ELASTIC.params({"hysteresis_slots": 1})
    assert ELASTIC3_MECHANISMS == {"spread_tail": True, "idle_demand": True}


def test_idle_training_cells_return_to_serve_the_queue_only_when_asked():
    """``idle_recall`` acts (tiny with a tail, seed 0: some satellites wait idle in training while the queue
    holds work) and is off by default, so a log recorded before it decides as before."""
    sc = tailed(**{"rollout.resume_s_per_mtoken": 20.0})
    recalls = {}
    for on in (False, True):
        params = policy_params(sc, ELASTIC_V3, {"partial_rollouts": True, "oversample_groups": 2,
                                                "backlog_loans": on, "idle_recall": on})
        sink = MemorySink()
        simulate(sc, "elastic", sink=sink, params=params, version="elastic/3", seed=0)
        recalls[on] = sum(e.kind == "role_switch_requested" and e.reason.startswith("idle in training")
                          for e in sink.events)
    assert recalls == {False: 0, True: recalls[True]} and recalls[True] > 0
    assert not ELASTIC_V3.params({}).backlog_loans and not ELASTIC_V3.params({}).idle_recall


def test_an_unstreamed_partial_step_gets_no_loan_before_it_can_start():
    """Live, a partial step starts only once its groups fill its batch (it does not stream). elastic/3 lent for a
    streamed step, so its lent cells waited idle in training: behind elastic/2 on the emulated cluster's
    workload. With ``idle_demand`` (the parameter rule) training counts as ready only once the step is full."""
    from gyre.cluster.emulated import played

    sc = played("seed-2.4t-scaled")
    unstreamed = {"stream_micro_steps": False, "partial_rollouts": True, "oversample_groups": 4}
    hours = {}
    for name, version, values in (("v2", None, unstreamed), ("v3", "elastic/3", unstreamed),
                                  ("v3 before", "elastic/3", {**unstreamed, "idle_demand": False})):
        policy = get_policy("elastic", version)
        params = policy.run_params(scenario_values(sc, policy, values))
        hours[name] = simulate(sc, "elastic", steps=2, version=version, params=params).hours
    assert hours["v3"] < hours["v2"] < hours["v3 before"], hours
