"""Running a scenario under a policy (or all three) and summarising the run."""

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gyre.scheduler import Policy, PolicyParams, get_policy
from gyre.sim.bound import lower_bound
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

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 4)
        return out


def policy_params(scenario: Scenario, policy: Policy, overrides: dict[str, Any] | None = None) -> PolicyParams:
    """The scenario's parameters for a policy: the shared staleness plus the policy's own section."""
    values: dict[str, Any] = {}
    if policy.name != "colocate":
        values["staleness"] = scenario.policy.staleness
    if policy.name == "elastic":
        values.update(scenario.policy.elastic.model_dump())
    elif policy.name == "async":
        values.update(scenario.policy.async_.model_dump())
    values.update(overrides or {})
    return policy.params(values)


def simulate(scenario: Scenario, policy_name: str, *, seed: int | None = None, steps: int | None = None,
             log_dir: str | Path | None = None, sink: EventSink | None = None, workload: Workload | None = None,
             params: PolicyParams | None = None) -> SimResult:
    policy = get_policy(policy_name)
    params = params or policy_params(scenario, policy)
    seed = scenario.seed if seed is None else seed
    workload = workload or sample_workload(scenario, seed, steps)
    run_id = f"sim-{scenario.name}-{policy.name}-s{seed}"
    if sink is None:
        sink = LogSink.create(log_dir, run_id, flush_interval_s=None) if log_dir is not None else NullSink()
    sim = Simulation(scenario, workload, policy, params, sink, seed=seed, run_id=run_id)
    try:
        makespan_us = sim.run()
    finally:
        sink.close()
    return summarise(sim, makespan_us, log_dir)


def summarise(sim: Simulation, makespan_us: int, log_dir: str | Path | None) -> SimResult:
    sc, workload = sim.scenario, sim.workload
    seconds = makespan_us / 1e6
    bound = lower_bound(sc, workload, sim.params.staleness)
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
        timed_out_share=sum(e.status == "timed_out" for e in executions) / max(1, len(executions)),
        log=str(log_dir) if log_dir is not None else None)


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
