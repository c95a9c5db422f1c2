"""Running a scenario under a policy (or all three) and summarising the run."""

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gyre.errors import ConfigError
from gyre.scheduler import ELASTIC3_MECHANISMS, ELASTIC3_PARTIAL_MECHANISMS, Policy, PolicyParams, get_policy
from gyre.sim.bound import lower_bound
from gyre.sim.breakdown import CellTime
from gyre.sim.engine import Simulation
from gyre.sim.scenario import Scenario
from gyre.sim.workload import Workload, sample_workload
from gyre.sink import EventSink, LogSink, NullSink

COMPARED = ("elastic", "colocate", "async")


@dataclass(frozen=True)
class SimResult:
    scenario: str
    policy: str
    policy_version: str
    seed: int
    steps: int
    staleness: int
    hours: float
    lower_bound_hours: float
    work_bound_hours: float
    critical_path_hours: float
    ratio_to_lower_bound: float
    utilization: float
    idle_gpu_hours: float
    role_switches: int
    redirects: int
    executions: int
    timed_out_share: float
    log: str | None
    partial_rollouts: bool = False
    cut_executions: int = 0
    """Executions cut on a cell leaving rollout and continued later (partial rollouts)."""
    carried_groups: int = 0
    """Groups trained by a later step than their own batch's (partial rollouts)."""
    max_group_lag: int = 0
    """Most versions between a trained group's first queueing and the step that trained it."""
    mixed_version_share: float = 0.0
    """Share of trained trajectories whose calls started under more than one policy version."""
    max_token_lag: int = 0
    """Most versions between a trained token's policy (its call's start) and the step that trained it."""
    resume_hours: float = 0.0
    """Time cut executions spent re-prefilling their context on resumption (``rollout.resume_s_per_mtoken``)."""
    cell_time: dict[str, float] | None = None
    """Where the cell-time went (``gyre.sim.breakdown``), when asked for: shares of cells x makespan."""

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 4)
        return out


def policy_params(scenario: Scenario, policy: Policy, overrides: dict[str, Any] | None = None) -> PolicyParams:
    """The scenario's parameters for a policy: the shared staleness plus the policy's own section.

    Elastic's expected switch costs default to the scenario's (an operator configures measured costs);
    the policy replaces them with the log's own measurements as switches happen.
    """
    return policy.params(scenario_values(scenario, policy, overrides))


def scenario_values(scenario: Scenario, policy: Policy, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parameter values the scenario sets for a policy (``policy_params``, unvalidated)."""
    values: dict[str, Any] = {}
    if policy.name == "elastic":
        values.update(switch_to_training_s=scenario.switch.to_training_s,
                      switch_to_rollout_s=scenario.switch.to_rollout_s,
                      satellite_join_s=scenario.training.satellite_join_s)
    values.update(scenario.policy.values(policy.name))
    values.update(overrides or {})
    return values


def simulate(scenario: Scenario, policy_name: str, *, seed: int | None = None, steps: int | None = None,
             log_dir: str | Path | None = None, sink: EventSink | None = None, workload: Workload | None = None,
             params: PolicyParams | None = None, version: str | None = None, cell_time: bool = False) -> SimResult:
    """One policy (its current version, or ``version`` when still shipped) on the scenario's work;
    ``cell_time``: also fold where the cell-time went (``gyre.sim.breakdown``; the run is unchanged).
    Without ``params``: the scenario's, under the version's parameter rule (``Policy.run_params``), as a live
    run from a config gets them."""
    policy = get_policy(policy_name, version)
    params = params or policy.run_params(scenario_values(scenario, policy))
    seed = scenario.seed if seed is None else seed
    workload = workload or sample_workload(scenario, seed, steps)
    run_id = f"sim-{scenario.name}-{policy.name}-s{seed}"
    if sink is None:
        sink = LogSink.create(log_dir, run_id, flush_interval_s=None) if log_dir is not None else NullSink()
    sim = Simulation(scenario, workload, policy, params, sink, seed=seed, run_id=run_id,
                     cell_time=CellTime() if cell_time else None)
    try:
        makespan_us = sim.run()
    finally:
        sink.close()
    return summarise(sim, makespan_us, log_dir)


def summarise(sim: Simulation, makespan_us: int, log_dir: str | Path | None) -> SimResult:
    sc, workload = sim.scenario, sim.workload
    seconds = makespan_us / 1e6
    bound = lower_bound(sc, workload, sim.params.staleness, sim.params.partial_rollouts, sim.seed)
    busy_s = sum(sim.stats.busy_us.values()) / 1e6
    cells = sc.cluster.cells
    executions = workload.executions()
    return SimResult(
        scenario=sc.name, policy=sim.policy.name, policy_version=sim.policy.version, seed=sim.seed,
        steps=workload.steps, staleness=sim.params.staleness, hours=seconds / 3600,
        lower_bound_hours=bound.seconds / 3600, work_bound_hours=bound.work_s / 3600,
        critical_path_hours=bound.critical_path_s / 3600, ratio_to_lower_bound=seconds / bound.seconds,
        utilization=busy_s / (cells * seconds),
        idle_gpu_hours=(cells * seconds - busy_s) * sc.cluster.gpus_per_cell / 3600,
        role_switches=sim.stats.switches, redirects=sim.stats.redirects, executions=len(executions),
        timed_out_share=(sim.rollouts.timed_out if sim.rollouts.timing is not None else
                         sum(e.status == "timed_out" for e in executions)) / max(1, len(executions)),
        log=str(log_dir) if log_dir is not None else None, partial_rollouts=sim.params.partial_rollouts,
        cut_executions=sim.rollouts.cuts, resume_hours=sim.rollouts.resume_s / 3600,
        cell_time=sim.cell_time.shares() if sim.cell_time is not None else None, **_lags(sim))


def _lags(sim: Simulation) -> dict[str, Any]:
    """How off-policy the trained data was: groups trained after their own batch's step, the largest
    version lag of a trained group (from its first queueing) and of a trained token (from the version
    its call started under: step ``s`` trains with version ``s``), and the share of trained trajectories
    whose calls span versions."""
    work = sim.view.work
    if work.partial_rollouts:
        trained = [(step, g) for step, groups in work.assigned.items() for g in groups]
    else:
        trained = [(s, g) for s, w in work.steps.items() for g in w.complete_groups]
    carried = sum(1 for step, g in trained if step > work.group_origin[g][0])
    lag = max((step - work.group_origin[g][1] for step, g in trained), default=0)
    members: dict[str, list[str]] = {}
    for e in sim.workload.executions():
        if e.trained:
            members.setdefault(e.group_id, []).append(e.execution_id)
    first, mixed = sim.rollouts.first_version, sim.rollouts.mixed
    token_lag, trajectories, mixing = 0, 0, 0
    for step, g in trained:
        for execution in members.get(g, ()):
            trajectories += 1
            mixing += execution in mixed
            token_lag = max(token_lag, step - first.get(execution, step))
    return {"carried_groups": carried, "max_group_lag": lag, "max_token_lag": token_lag,
            "mixed_version_share": mixing / max(1, trajectories)}


def compare(scenario: Scenario, *, seed: int | None = None, steps: int | None = None,
            log_dir: str | Path | None = None) -> dict[str, Any]:
    """All three policies on the same workload, with elastic's speedups over the baselines."""
    seed = scenario.seed if seed is None else seed
    workload = sample_workload(scenario, seed, steps)
    runs = {}
    for name in COMPARED:
        log = Path(log_dir) / name if log_dir is not None else None
        runs[name] = simulate(scenario, name, seed=seed, workload=workload, log_dir=log)
    elastic = runs["elastic"].hours
    return {
        "scenario": scenario.name, "seed": seed, "steps": workload.steps, "staleness": scenario.policy.staleness,
        "policies": [r.to_dict() for r in runs.values()],
        "speedup_vs_colocate": round(runs["colocate"].hours / elastic, 4),
        "speedup_vs_async": round(runs["async"].hours / elastic, 4),
        "targets": scenario.targets.model_dump(),
    }


@dataclass(frozen=True)
class Variant:
    """One row of an ablation: a policy with some parameters changed from the scenario's."""

    name: str
    policy: str
    overrides: dict[str, Any]
    role: str
    """elastic | colocate | async (+partial), elastic3 (+partial): the design it stands for."""
    version: str | None = None
    """A shipped policy version other than the current one (``elastic/3`` while it is not the default)."""


def oversample_sweep(scenario: Scenario, sweep: Sequence[int] | None = None) -> list[int]:
    """Over-sampled groups tried with partial rollouts: ``sweep`` (``--oversample``, each at most a batch), by
    default a quarter and half a batch (the sweep before over-sampling past half a batch was allowed)."""
    groups = scenario.batch.groups
    if sweep is not None:
        bad = [k for k in sweep if not 1 <= k <= groups]
        if bad or not sweep:
            raise ConfigError(f"--oversample: each value must be 1..{groups} (a batch), got {list(sweep)}")
        return sorted(set(sweep))
    return sorted({max(1, groups // 4), groups // 2} - {0})


def ablation_variants(scenario: Scenario, sweep: Sequence[int] | None = None) -> list[Variant]:
    """Elastic with and without its mechanisms; every baseline with and without each one it can use.

    Partial rollouts are given to every design in its best form (with streaming, over-sampling a quarter
    or half a batch; for async, every split), so the comparison with them is matched too.
    """
    out = [Variant("elastic", "elastic", {}, "elastic"),
           Variant("elastic, no streaming", "elastic", {"stream_micro_steps": False}, "elastic"),
           Variant("elastic, no migration", "elastic", {"migrate": False}, "elastic"),
           Variant("colocate (brief)", "colocate", {"stream_micro_steps": False}, "colocate"),
           Variant("colocate + streaming", "colocate", {"stream_micro_steps": True}, "colocate")]
    shipped = policy_params(scenario, get_policy("async")).training_cells  # type: ignore[attr-defined]
    out.append(Variant(f"async (brief, {shipped} training)", "async",
                       {"stream_micro_steps": False, "training_cells": shipped}, "async"))
    for cells in range(1, scenario.cluster.cells):
        for stream in (False, True):
            if cells == shipped and not stream:
                continue
            label = f"async {cells} training" + (" + streaming" if stream else "")
            out.append(Variant(label, "async", {"stream_micro_steps": stream, "training_cells": cells}, "async"))
    for k in oversample_sweep(scenario, sweep):
        partial = {"partial_rollouts": True, "oversample_groups": k}
        suffix = f" + partial rollouts ({k} over-sampled)"
        out.append(Variant("elastic" + suffix, "elastic", partial, "elastic+partial"))
        out.append(Variant("colocate + streaming" + suffix, "colocate", {"stream_micro_steps": True, **partial},
                           "colocate+partial"))
        for cells in range(1, scenario.cluster.cells):
            out.append(Variant(f"async {cells} training + streaming" + suffix, "async",
                               {"stream_micro_steps": True, "training_cells": cells, **partial}, "async+partial"))
    return out + elastic3_variants(scenario, sweep)


def elastic3_variants(scenario: Scenario, sweep: Sequence[int] | None = None) -> list[Variant]:
    """elastic/3 with and without partial rollouts, and (at the most over-sampling up to half a batch, where
    it is at its best on the shipped scenarios, docs/simulator.md round 4) with each of its mechanisms off:
    cutting what the next step does not need, at staleness >= 1 the rate split, at staleness 0 the
    spreading of the tail, loans against the ready backlog and the recall of idle cells."""
    v3 = "elastic/3"
    out = [Variant("elastic/3", "elastic", ELASTIC3_MECHANISMS, "elastic3", v3)]
    if not scenario.policy.staleness:
        out.append(Variant("elastic/3, no tail spreading", "elastic", {**ELASTIC3_MECHANISMS, "spread_tail": False},
                           "elastic3 ablation", v3))
    sweep = oversample_sweep(scenario, sweep)
    for k in sweep:
        out.append(Variant(f"elastic/3 + partial rollouts ({k} over-sampled)", "elastic",
                           {"partial_rollouts": True, "oversample_groups": k, **ELASTIC3_PARTIAL_MECHANISMS},
                           "elastic3+partial", v3))
    k = max((k for k in sweep if 2 * k <= scenario.batch.groups), default=sweep[0])
    most = {"partial_rollouts": True, "oversample_groups": k, **ELASTIC3_PARTIAL_MECHANISMS}
    off = [("no cuts", {"cut_unneeded": False}), ("no backlog loans", {"backlog_loans": False}),
           ("no idle recall", {"idle_recall": False})]
    if scenario.policy.staleness >= 1:
        off.append(("no rate split", {"rate_split": False}))
    else:
        off.append(("no tail spreading", {"spread_tail": False}))
    for label, change in off:
        out.append(Variant(f"elastic/3 + partial rollouts ({k} over-sampled), {label}", "elastic",
                           {**most, **change}, "elastic3 ablation", v3))
    return out


def ablate(scenario: Scenario, *, seed: int | None = None, steps: int | None = None,
           sweep: Sequence[int] | None = None) -> dict[str, Any]:
    """Elastic against the best-tuned baselines given the same mechanisms, and its lead decomposed.

    Every run faces the same executions at the scenario's staleness (colocate: 0). Speedups are
    baseline hours over elastic hours: below 1, elastic loses. The headline comparison is without partial
    rollouts (the scenario's designs); ``partial_rollouts`` repeats it with partial rollouts for every
    design (``gain``: each design's best with them over its best without; their carried groups are up to
    ``staleness + 1`` versions old, so this is a comparison at a looser staleness for all alike). The
    decomposition multiplies out to elastic's lead over the brief's colocate: streaming (colocate ->
    colocate + streaming), elasticity (-> elastic without migration: lending drained cells) and
    migration (-> elastic).
    """
    seed = scenario.seed if seed is None else seed
    workload = sample_workload(scenario, seed, steps)
    rows = []
    for v in ablation_variants(scenario, sweep):
        policy = get_policy(v.policy, v.version)
        params = policy_params(scenario, policy, v.overrides)
        r = simulate(scenario, v.policy, seed=seed, workload=workload, params=params, version=v.version)
        rows.append({"variant": v.name, "design": v.role, "policy_version": r.policy_version,
                     "params": params.model_dump(exclude={"switch_to_training_s", "switch_to_rollout_s",
                                                          "satellite_join_s"}),
                     "hours": round(r.hours, 4), "lower_bound_hours": round(r.lower_bound_hours, 4),
                     "ratio_to_lower_bound": round(r.ratio_to_lower_bound, 4), "role_switches": r.role_switches,
                     "cut_executions": r.cut_executions, "carried_groups": r.carried_groups,
                     "max_group_lag": r.max_group_lag, "mixed_version_share": round(r.mixed_version_share, 4),
                     "max_token_lag": r.max_token_lag, "resume_hours": round(r.resume_hours, 4)})
    hours = {r["variant"]: r["hours"] for r in rows}
    elastic = hours["elastic"]

    def best(design: str) -> dict[str, Any]:
        return min((r for r in rows if r["design"] == design), key=lambda r: r["hours"])

    best_colocate, best_async = best("colocate"), best("async")
    best_baseline = min(best_colocate, best_async, key=lambda r: r["hours"])
    lead = best_baseline["hours"] / elastic
    with_partial = {design: best(design + "+partial") for design in ("elastic", "colocate", "async")}
    partial_baseline = min(with_partial["colocate"], with_partial["async"], key=lambda r: r["hours"])
    partial_lead = partial_baseline["hours"] / with_partial["elastic"]["hours"]
    partial = {
        "best_elastic": with_partial["elastic"]["variant"], "best_colocate": with_partial["colocate"]["variant"],
        "best_async": with_partial["async"]["variant"],
        "gain": {design: round(best(design)["hours"] / row["hours"], 4) if design != "elastic" else
                 round(elastic / row["hours"], 4) for design, row in with_partial.items()},
        "speedup_vs_best_baseline": round(partial_lead, 4),
        "max_group_lag": max(r["max_group_lag"] for r in rows if r["design"].endswith("+partial")),
    }
    v3, v3_partial = best("elastic3"), best("elastic3+partial")
    elastic3 = {
        "best": v3_partial["variant"],
        "speedup_vs_best_baseline": round(best_baseline["hours"] / v3["hours"], 4),
        "speedup_vs_best_baseline_partial": round(partial_baseline["hours"] / v3_partial["hours"], 4),
        "ratio_to_lower_bound": v3["ratio_to_lower_bound"],
        "ratio_to_lower_bound_partial": v3_partial["ratio_to_lower_bound"],
        "speedup_vs_elastic2": round(elastic / v3["hours"], 4),
        "speedup_vs_elastic2_partial": round(with_partial["elastic"]["hours"] / v3_partial["hours"], 4),
        "mechanisms": {r["variant"]: round(r["hours"] / hours[r["variant"].rsplit(",", 1)[0]], 4)
                       for r in rows if r["design"] == "elastic3 ablation"},
    }
    x = {name: round(hours[name] / elastic, 4) for name in hours if name != "elastic"}
    decomposition = {
        "streaming": round(hours["colocate (brief)"] / hours["colocate + streaming"], 4),
        "elasticity": round(hours["colocate + streaming"] / hours["elastic, no migration"], 4),
        "migration": round(hours["elastic, no migration"] / elastic, 4),
        "total_vs_brief_colocate": round(hours["colocate (brief)"] / elastic, 4),
    }
    if lead >= 1:
        verdict = f"elastic wins: {lead:.3f}x faster than the best baseline ({best_baseline['variant']})"
    else:
        verdict = (f"elastic loses: the best baseline ({best_baseline['variant']}) is {1 / lead:.3f}x faster "
                   f"({best_baseline['hours']:.2f} h vs {elastic:.2f} h)")
    return {
        "scenario": scenario.name, "seed": seed, "steps": workload.steps, "staleness": scenario.policy.staleness,
        "runs": rows, "speedup": x, "best_colocate": best_colocate["variant"], "best_async": best_async["variant"],
        "speedup_vs_best_colocate": round(best_colocate["hours"] / elastic, 4),
        "speedup_vs_best_async": round(best_async["hours"] / elastic, 4),
        "speedup_vs_best_baseline": round(lead, 4), "decomposition": decomposition, "verdict": verdict,
        "partial_rollouts": partial, "elastic3": elastic3,
    }
