"""The ablation: every baseline given every mechanism, elastic's lead decomposed, and the issue's checks."""

import pytest

from gyre.scheduler import get_policy
from gyre.sim.runner import ablate, ablation_variants, policy_params, simulate
from gyre.sim.scenario import load_scenario, with_values
from gyre.sim.workload import sample_workload


def test_every_baseline_gets_every_mechanism_it_can_use():
    variants = ablation_variants(load_scenario("seed-2.4t"))
    async_rows = {(v.overrides["training_cells"], v.overrides["stream_micro_steps"]) for v in variants
                  if v.role == "async"}
    assert async_rows == {(cells, stream) for cells in (1, 2, 3) for stream in (False, True)}
    assert {v.overrides.get("stream_micro_steps") for v in variants if v.role == "colocate"} == {False, True}
    assert {v.name for v in variants if v.role == "elastic"} == {
        "elastic", "elastic, no streaming", "elastic, no migration"}


def test_every_design_gets_partial_rollouts_at_every_over_sampling_tried():
    """seed-2.4t has 16 groups a step: 4 and 8 over-sampled groups, for elastic, colocate and every split."""
    variants = [v for v in ablation_variants(load_scenario("seed-2.4t"))
                if v.overrides.get("partial_rollouts") and v.version is None]
    assert {(v.role, v.overrides["oversample_groups"], v.overrides.get("training_cells")) for v in variants} == {
        (role, k, cells) for k in (4, 8) for role, cells in (("elastic+partial", None), ("colocate+partial", None))
    } | {("async+partial", k, cells) for k in (4, 8) for cells in (1, 2, 3)}
    assert all(v.overrides["stream_micro_steps"] for v in variants if v.role != "elastic+partial")


def test_elastic3_runs_beside_elastic2_with_each_of_its_mechanisms_off():
    """elastic/3 is not the default, so its rows name their version; the rate split is ablated only where
    it acts (staleness >= 1), the tail spreading where it acts (staleness 0); its partial-rollout rows run
    with loans against the ready backlog and the recall of idle cells, each also switched off alone."""
    sc = load_scenario("seed-2.4t")
    v3 = [v for v in ablation_variants(sc) if v.version == "elastic/3"]
    assert {(v.role, v.overrides.get("oversample_groups")) for v in v3} == {
        ("elastic3", None), ("elastic3 ablation", None), ("elastic3+partial", 4), ("elastic3+partial", 8),
        ("elastic3 ablation", 8)}
    assert sum(not v.overrides.get("spread_tail", False) for v in v3) == 2  # the tail ablated at staleness 0
    stale = with_values(sc, {"policy.staleness": 1})
    assert sum(v.role == "elastic3 ablation" for v in ablation_variants(stale)) == 4
    partial = [v for v in v3 if v.overrides.get("partial_rollouts")]
    assert all(v.overrides["backlog_loans"] and v.overrides["idle_recall"] for v in partial
               if not v.name.endswith(("no backlog loans", "no idle recall")))


def test_the_ablation_reports_every_run_and_a_decomposition_that_multiplies_out():
    out = ablate(load_scenario("tiny"), steps=2)
    hours = {r["variant"]: r["hours"] for r in out["runs"]}
    d = out["decomposition"]
    assert d["streaming"] * d["elasticity"] * d["migration"] == pytest.approx(d["total_vs_brief_colocate"], rel=1e-3)
    best = min(r["hours"] for r in out["runs"] if r["design"] in ("colocate", "async"))
    assert out["speedup_vs_best_baseline"] == pytest.approx(best / hours["elastic"], rel=1e-3)
    assert out["verdict"].startswith("elastic wins" if best >= hours["elastic"] else "elastic loses")
    assert all(r["ratio_to_lower_bound"] >= 1 for r in out["runs"])
    pr = out["partial_rollouts"]
    partial = {design: min(r["hours"] for r in out["runs"] if r["design"] == design + "+partial")
               for design in ("elastic", "colocate", "async")}
    assert pr["speedup_vs_best_baseline"] == pytest.approx(
        min(partial["colocate"], partial["async"]) / partial["elastic"], rel=1e-3)
    assert pr["max_group_lag"] <= out["staleness"] + 1
    e3 = out["elastic3"]
    v3_partial = min(r["hours"] for r in out["runs"] if r["design"] == "elastic3+partial")
    assert e3["speedup_vs_best_baseline_partial"] == pytest.approx(
        min(partial["colocate"], partial["async"]) / v3_partial, rel=1e-3)
    assert all(r["max_token_lag"] <= out["staleness"] + 1 and 0 <= r["mixed_version_share"] <= 1
               for r in out["runs"])


def _hours(scenario, policy: str, overrides: dict, workload) -> float:
    params = policy_params(scenario, get_policy(policy), overrides)
    return simulate(scenario, policy, workload=workload, params=params).hours


@pytest.mark.slow
def test_with_no_tail_elastic_is_within_2_percent_of_colocate_with_streaming():
    sc = load_scenario("no-tail")
    work = sample_workload(sc, sc.seed)
    elastic = _hours(sc, "elastic", {}, work)
    colocate = _hours(sc, "colocate", {"stream_micro_steps": True}, work)
    assert abs(elastic / colocate - 1) <= 0.02


@pytest.mark.slow
def test_with_half_hour_switches_elastic_is_within_5_percent_of_the_best_baseline():
    """The best baseline at 1,800 s switches is async with 2 training cells and streaming (the ablation's
    sweep, docs/simulator.md); colocate pays two switches a step and is far behind."""
    sc = with_values(load_scenario("seed-2.4t"), {"switch.to_training_s": 1800, "switch.to_rollout_s": 1800})
    work = sample_workload(sc, sc.seed)
    elastic = _hours(sc, "elastic", {}, work)
    best = _hours(sc, "async", {"training_cells": 2, "stream_micro_steps": True}, work)
    assert elastic <= 1.05 * best
