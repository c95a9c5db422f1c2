"""`gyre run CONFIG --emulate SCENARIO`: a live run facing a scenario's emulated cluster and workload.

The run keeps ``CONFIG``'s model, engine, trainer, trajectory and cluster settings, and takes from the
scenario what `gyre sim` simulates: its cells and slots, steps, groups and group size, timeout, the policy's
parameters (switch costs in wall seconds), every cell's accelerator (``[emulate]``, `gyre.emulate`) and the
workload itself. Each group of each step is one task whose prompt is the per-call description of its
rollouts (`gyre.sim.calls`): the scenario agent (``agents/scenario_agent``), a black-box OpenAI-API
harness, makes exactly those calls; the task set's grader gives each execution the reward the workload drew
for it after its evaluation time, and fails the evaluations the workload says fail. The simulator and the
live run therefore face the same executions (the same seed).

Everything is written to ``RUN_DIR/scenario`` (``tasks.toml``, the grading tables there and nowhere the
harness can read them), then applied as overrides, checked as keys in the file would be.

The simulator a live run is compared with (`measure`; `benchmarks.cluster_compare`) times the scenario's
executions call by call (`played`: ``calls.simulate``), as the live run plays them: tool waits off the cell,
each call's decode in the batch of the calls decoding beside it. The aggregate model a scenario may default
to stretches a whole execution, waits included, with its cell's load, which no live run does.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from gyre.cluster.config import ClusterConfig
from gyre.log import LogReader
from gyre.scheduler import get_policy
from gyre.sim.calls import SET_FORMAT, CallTiming, plan_calls
from gyre.sim.runner import simulate
from gyre.sim.scenario import Scenario, load_scenario, with_policy_values, with_values
from gyre.sim.workload import sample_workload

REPO = Path(__file__).resolve().parents[2]
AGENT_DIR = REPO / "agents" / "scenario_agent"


def played(scenario_name: str) -> Scenario:
    """The scenario as a live emulated run plays it, for the simulator to time: call by call."""
    return with_values(load_scenario(scenario_name), {"calls.simulate": True})


def scenario_overrides(config: ClusterConfig, scenario_name: str, *, time_scale: float, token_scale: float,
                       seed: int | None = None, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the scenario's task set under ``config.run_dir`` and return the overrides that make ``config``
    run it (module docstring). The policy runs with the scenario's parameters, not the config file's (those
    are tuned for the file's own workload), changed only by ``params`` (an ablation's variant)."""
    if time_scale <= 0 or token_scale <= 0:
        raise ValueError(f"--time-scale and --token-scale must be positive (given {time_scale} and {token_scale})")
    scenario = load_scenario(scenario_name)
    seed = scenario.seed if seed is None else seed
    workload, timing = sample_workload(scenario, seed), CallTiming(scenario)
    size, groups = scenario.batch.group_size, scenario.batch.groups
    tasks, longest = [], 1
    for batch in workload.batches:
        for g in range(groups):
            members = batch[g * size:(g + 1) * size]
            plans = [plan_calls(scenario, e, seed, timing) for e in members]
            longest = max([longest, *(math.ceil(c.output_tokens / token_scale) for p in plans for c in p.calls)])
            description = {"format": SET_FORMAT, "scenario": scenario.name, "seed": seed, "steps": workload.steps,
                           "executions": [p.to_json(time_scale=time_scale, token_scale=token_scale) for p in plans]}
            grading = {"time_scale": time_scale, "rollouts": [
                {"reward": e.reward, "eval_s": e.eval_s, "eval_failed": e.eval_failed} for e in members]}
            tasks.append((members[0].task_id, json.dumps(description), grading))
    out = Path(config.run_dir) / "scenario"
    out.mkdir(parents=True, exist_ok=True)
    eval_timeout = 30 + max(r["eval_s"] for _, _, g in tasks for r in g["rollouts"]) / time_scale
    (out / "tasks.toml").write_text(_task_set(scenario.name, seed, tasks, eval_timeout))
    shutil.copy(AGENT_DIR / "grade.py", out / "grade.py")  # a sandboxed evaluator reads only its task set's dir
    policy = config.scheduler.policy
    costs = {"switch_to_training_s": scenario.switch.to_training_s / time_scale,
             "switch_to_rollout_s": scenario.switch.to_rollout_s / time_scale,
             "satellite_join_s": scenario.training.satellite_join_s / time_scale}
    takes = get_policy(policy, config.scheduler.version).params_type.model_fields  # colocate, async: no switches
    params = {**scenario.policy.values(policy), **(params or {}),
              **{key: value for key, value in costs.items() if key in takes}}
    staleness = params.pop("staleness", 0)  # the scenario's, as `gyre sim` gives it (colocate: 0, synchronous)
    cluster = scenario.cluster
    return {
        "steps": scenario.steps, "cluster.cells": cluster.cells, "cluster.slots": cluster.slots_per_cell,
        "scheduler.staleness": staleness, "scheduler.params": params, "scheduler.wait_for_lent_cells": False,
        "rollout.tasks": str(out / "tasks.toml"), "rollout.task_ids": [task_id for task_id, _, _ in tasks],
        "rollout.harness": str(AGENT_DIR / "harness.toml"), "rollout.groups_per_step": groups,
        "rollout.group_size": size, "trajectory.micro_steps_per_group": scenario.batch.micro_steps_per_group,
        "rollout.timeout_s": scenario.rollout.timeout_s / time_scale,
        "rollout.max_concurrency": cluster.cells * cluster.slots_per_cell,
        "sampling.ignore_eos": True, "sampling.max_tokens": longest,
        "emulate": {"scenario": scenario_name, "time_scale": time_scale, "token_scale": token_scale},
    }


def _task_set(name: str, seed: int, tasks: list[tuple[str, str, dict[str, Any]]], eval_timeout_s: float) -> str:
    """The task set as TOML (JSON's string, number and boolean literals are TOML's too)."""
    lines = [f"# written by `gyre run --emulate {name}` (seed {seed}): one task per group of the workload",
             f"name = {json.dumps(f'scenario-{name}')}",
             "", "[evaluator]", 'type = "command"', 'name = "scenario-grader"',
             'command = ["{python}", "{taskset_dir}/grade.py", "{grading_file}", "{execution_id}"]',
             f"timeout_s = {eval_timeout_s:.3f}"]
    for task_id, prompt, grading in tasks:
        rollouts = ", ".join(f"{{ reward = {r['reward']}, eval_s = {r['eval_s']}, eval_failed = "
                             f"{json.dumps(r['eval_failed'])} }}" for r in grading["rollouts"])
        lines += ["", "[[tasks]]", f"id = {json.dumps(task_id)}", f"prompt = {json.dumps(prompt)}",
                  "[tasks.grading]", f"time_scale = {grading['time_scale']}", f"rollouts = [{rollouts}]"]
    return "\n".join(lines) + "\n"


COMPARED_PARAMS = ("stream_micro_steps", "partial_rollouts", "oversample_groups", "hysteresis_slots", "cut_unneeded",
                   "rate_split", "backlog_loans", "idle_recall", "spread_tail")
"""The run's policy parameters the prediction takes (switch and join times are the scenario's, unscaled)."""

_STEPS = """
SELECT s.step, s.planned_micro_steps, epoch(s.ts) AS opened, epoch(f.ts) AS finished,
       (SELECT epoch(max(r.ts)) FROM rewards r JOIN executions_queued q USING (execution_id)
        WHERE q.step = s.step) AS last_reward
FROM train_steps_started s JOIN train_steps f USING (step) ORDER BY s.step
"""


def measure(run_dir: Path) -> dict[str, Any]:
    """A finished `gyre run CONFIG --emulate SCENARIO` run against `gyre sim` for the same workload and policy
    parameters, timed call by call (`played`; `python -m benchmarks.stream_live` prints it): emulated and
    predicted seconds, ``sim_error`` = predicted / live - 1, per step when it opened, got its last reward and
    finished, and ``agents``: the host time the scenario agents made up from their waits (``lag_s``: their
    requests' way to the proxy) and what they still owed at their end (``late_s``), in real seconds."""
    config = json.loads((run_dir / "cluster-config.json").read_text())
    emulate = config["emulate"]
    scale = float(emulate["time_scale"])
    con = LogReader(run_dir / "log").duckdb()
    start, end = con.execute("SELECT epoch(min(ts)) FROM executions_queued").fetchone()[0], \
        con.execute("SELECT epoch(max(ts)) FROM weights_published").fetchone()[0]
    policy, version, raw = con.execute("SELECT policy, policy_version, policy_params FROM runs_started").fetchone()
    params = json.loads(raw)
    steps = [{"step": step, "planned_micro_steps": planned, "opened_s": round((opened - start) * scale, 1),
              "last_reward_s": round((last - start) * scale, 1), "finished_s": round((done - start) * scale, 1)}
             for step, planned, opened, done, last in con.execute(_STEPS).fetchall()]
    scenario = with_policy_values(played(emulate["scenario"]), {
        "staleness": params.get("staleness", 0),
        **{f"{policy}.{k}": params[k] for k in COMPARED_PARAMS if k in params}})
    predicted = simulate(scenario, policy, steps=len(steps), version=version).hours * 3600
    live = (end - start) * scale
    return {"run_dir": str(run_dir), "scenario": emulate["scenario"], "policy": version, "time_scale": scale,
            "params": {k: params[k] for k in COMPARED_PARAMS if k in params}, "wall_s": round(end - start, 1),
            "emulated_s": round(live, 1), "predicted_s": round(predicted, 1),
            "sim_error": round(predicted / live - 1, 4), "steps": steps, "agents": agent_reports(run_dir)}


def agent_reports(run_dir: Path) -> dict[str, float]:
    """The scenario agents' last stdout lines (their reports) summed over the run's executions."""
    total = {"reports": 0, "lag_s": 0.0, "late_s": 0.0}
    for out in sorted((run_dir / "executions").glob("*/harness.stdout")):
        lines = out.read_text(errors="replace").strip().splitlines()
        try:
            report = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            continue
        if isinstance(report, dict) and report.get("type") == "result" and "late_s" in report:
            total["reports"] += 1
            total["lag_s"] += float(report.get("lag_s", 0.0))
            total["late_s"] += float(report["late_s"])
    return {k: round(v, 2) for k, v in total.items()}
