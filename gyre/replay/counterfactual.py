"""Counterfactual replay: re-time a recorded run's executions under another policy with the simulator.

The executions keep what the log says about them: duration, calls, tokens, evaluation time (from the
finish to the reward or evaluator failure), reward, status, step and group; only the scheduling changes.
Time an execution spent paused while its KV blocks migrated after a redirect is taken out first, since
another policy would redirect differently (migrations out of one cell at one instant shared its egress,
as the simulator models them). Re-timing a simulated log under its own policy therefore reproduces its
recorded makespan exactly when decode speed does not depend on load (``decode.share = 0``); otherwise the
recorded durations, taken under the recorded load, are re-timed as if they were full-cell durations.
"""

import json
from collections import Counter
from pathlib import Path
from typing import Any

from gyre.errors import ConfigError
from gyre.events.models import RunStarted
from gyre.log import LogReader
from gyre.replay.exact import ReplayError, recorded_policy
from gyre.scheduler import get_policy
from gyre.sim.clock import US, to_us
from gyre.sim.rollouts import shared_transfer_s
from gyre.sim.runner import SimResult, policy_params, simulate
from gyre.sim.scenario import Scenario, load_scenario, parse_scenario
from gyre.sim.workload import ExecutionSpec, Workload

_EXECUTIONS = """
WITH calls AS (
    SELECT execution_id, count(*) AS calls, sum(len(prompt_delta_ids) + len(output_ids)) AS call_tokens
    FROM model_calls GROUP BY execution_id),
evaluated AS (
    SELECT execution_id, reward, ts, FALSE AS failed FROM rewards
    UNION ALL SELECT execution_id, NULL, ts, TRUE FROM evaluation_failures)
SELECT q.execution_id, q.task_id, q.group_id, q.step, f.status, f.duration_s,
       coalesce(f.tokens, c.call_tokens, 0) AS tokens, coalesce(c.calls, 1) AS calls,
       coalesce(e.reward, 0.0) AS reward, coalesce(epoch_us(e.ts) - epoch_us(f.ts), 0) AS eval_us,
       coalesce(e.failed, FALSE) AS eval_failed
FROM executions_queued q
JOIN executions_finished f USING (execution_id)
LEFT JOIN calls c USING (execution_id)
LEFT JOIN evaluated e USING (execution_id)
ORDER BY q.seq
"""


def measured_scenario(log_path: str | Path, start: RunStarted) -> Scenario:
    """Costs measured from a live run's own log: its role switches, train steps and publishes.

    The executions themselves are re-timed from their recorded durations, so only the costs a policy
    changes need measuring; the rest of the shape comes from the ``tiny`` scenario and is overridden by
    the recorded cells and batches (``retime_run``).
    """
    con = LogReader(log_path).duckdb()

    def mean(sql: str, default: float) -> float:
        (value,) = con.execute(sql).fetchone()
        return float(value) if value is not None else default

    base = load_scenario("tiny")
    # Per token of the workload: the simulator charges a step its executions' tokens (`workload_from_log`),
    # not the tokens the trainer forwarded (a group's shared prompt once, at most 5 trajectories kept), so
    # the rate is the steps' time over those same tokens. Measured per forwarded token and charged per
    # workload token, a re-timed step took 3.7x its recorded time: the simulator's +58% / +82% on async in
    # the live comparison (issue 26, deliverable 7; `tests/train/test_train_smoke.py`).
    per_mtoken = mean(f"""
        WITH executions AS ({_EXECUTIONS}),
        trained AS (SELECT step, sum(duration_s) AS seconds FROM train_steps WHERE tokens > 0 GROUP BY step)
        SELECT sum(t.seconds) / nullif((SELECT sum(tokens) FROM executions e WHERE e.step IN
                                        (SELECT step FROM trained)), 0) * 1e6 FROM trained t""",
                      base.training.s_per_mtoken)
    training = base.training.model_copy(update={
        "s_per_mtoken": max(per_mtoken, 1e-6), "optimizer_s": 0.0, "satellite_join_s": 0.0,
        "publish_s": mean("SELECT avg(duration_s) FROM weights_published", 0.0)})
    switch = base.switch.model_copy(update={
        "to_training_s": mean("SELECT avg(duration_s) FROM role_switches WHERE to_role = 'training'",
                              base.switch.to_training_s),
        "to_rollout_s": mean("SELECT avg(duration_s) FROM role_switches WHERE to_role = 'rollout'",
                             base.switch.to_rollout_s)})
    return base.model_copy(update={"name": f"measured from {start.run_id}", "training": training,
                                   "switch": switch})


def run_scenario(start: RunStarted, scenario: str | None, log_path: str | Path | None = None) -> Scenario:
    """The costs to re-time with: the ``--scenario`` given, else the configuration the run recorded (a
    simulated run), else costs measured from the log (a live run)."""
    if scenario is not None:
        return load_scenario(scenario)
    if start.decision_points == "explicit" and log_path is not None:
        return measured_scenario(log_path, start)
    try:
        return parse_scenario(json.loads(start.config), source=f"run_started.config of {start.run_id}")
    except (ConfigError, json.JSONDecodeError) as error:
        raise ReplayError(f"run {start.run_id} did not record a simulator scenario ({error}); give one with "
                          f"--scenario NAME to borrow its cluster and cost parameters") from error


def _migration_pauses(con, scenario: Scenario) -> dict[str, int]:
    """Microseconds each execution waited for its KV blocks after redirects (see ``shared_transfer_s``)."""
    rollout = scenario.rollout
    cell_bw = rollout.kv_cell_gb_per_s * 1e9 if rollout.kv_cell_gb_per_s is not None else None
    departures: dict[tuple, list[tuple[str, int]]] = {}
    for execution_id, kv_bytes, ts, from_cell in con.execute(
            "SELECT execution_id, kv_bytes, epoch_us(ts), from_cell_id FROM call_redirects ORDER BY seq").fetchall():
        departures.setdefault((ts, from_cell), []).append((execution_id, kv_bytes or 0))
    pauses: dict[str, int] = {}
    for moved in departures.values():
        seconds = shared_transfer_s([float(b) for _, b in moved], rollout.kv_gb_per_s * 1e9, cell_bw)
        for (execution_id, _), pause_s in zip(moved, seconds, strict=True):
            pauses[execution_id] = pauses.get(execution_id, 0) + to_us(pause_s)
    return pauses


def workload_from_log(log_path: str | Path, scenario: Scenario) -> Workload:
    """The recorded executions, batched by step (only steps whose every execution finished)."""
    con = LogReader(log_path).duckdb()
    rows = con.execute(_EXECUTIONS).fetchall()
    pauses = _migration_pauses(con, scenario)
    queued = {step: n for step, n in con.execute(
        "SELECT coalesce(step, -1), count(*) FROM executions_queued GROUP BY 1").fetchall()}
    batches: dict[int, list[ExecutionSpec]] = {}
    for (execution_id, task_id, group_id, step, status, duration, tokens, calls, reward, eval_us,
         eval_failed) in rows:
        if step is None:
            raise ReplayError(f"execution {execution_id} in {log_path} was queued without a step; "
                              f"counterfactual re-timing needs to know each step's batch")
        intrinsic = (to_us(duration) - pauses.get(execution_id, 0)) / US
        batches.setdefault(step, []).append(ExecutionSpec(
            execution_id=execution_id, task_id=task_id, group_id=group_id, step=step, duration_s=intrinsic,
            status=status, calls=int(calls), tokens=int(tokens), eval_s=eval_us / US,
            eval_failed=bool(eval_failed), reward=float(reward)))
    complete = [step for step in sorted(batches) if len(batches[step]) == queued.get(step)]
    kept = [step for i, step in enumerate(complete) if step == i]  # a gapless prefix of whole steps
    if not kept:
        raise ReplayError(f"log {log_path} holds no complete step to re-time")
    return Workload(tuple(tuple(batches[step]) for step in kept))


def recorded_hours(log_path: str | Path) -> float:
    con = LogReader(log_path).duckdb()
    (seconds,) = con.execute("SELECT epoch(max(ts)) - epoch(min(ts)) FROM events").fetchone()
    return float(seconds) / 3600


def retime_run(log_path: str | Path, policy: str, *, scenario: str | None = None,
               params: dict[str, Any] | None = None) -> SimResult:
    """Simulate the recorded executions of a log under ``policy`` (at the recorded staleness; under the
    recorded policy, with its recorded parameters unless ``params`` says otherwise)."""
    start = next(LogReader(log_path).events(to_seq=0), None)
    if not isinstance(start, RunStarted):
        raise ReplayError(f"log {log_path} does not begin with run_started")
    sc = run_scenario(start, scenario, log_path)
    _, recorded_params = recorded_policy(start)
    cells = LogReader(log_path).duckdb().execute("SELECT count(*), max(slots) FROM cells").fetchone()
    if cells[0] and (cells[0], cells[1]) != (sc.cluster.cells, sc.cluster.slots_per_cell):
        sc = sc.model_copy(update={"cluster": sc.cluster.model_copy(
            update={"cells": cells[0], "slots_per_cell": cells[1]})})
    sc = sc.model_copy(update={"policy": sc.policy.model_copy(update={"staleness": recorded_params.staleness})})
    workload = workload_from_log(log_path, sc)
    groups = {len({e.group_id for e in batch}) for batch in workload.batches}
    sizes = {n for batch in workload.batches for n in Counter(e.group_id for e in batch).values()}
    if len(groups) == 1 and len(sizes) == 1:  # the recorded batch shape, not the borrowed scenario's
        sc = sc.model_copy(update={"batch": sc.batch.model_copy(
            update={"groups": groups.pop(), "group_size": sizes.pop()})})
    chosen = get_policy(policy)
    if params is None and chosen.name == start.policy:
        params = recorded_params.model_dump()  # the recorded run's own settings
    return simulate(sc, policy, workload=workload, seed=start.seed or 0, params=policy_params(sc, chosen, params))


def retime(log_path: str | Path, policy: str, *, scenario: str | None = None,
           params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Estimated hours of the recorded work under ``policy``, and the speedup over the recorded run."""
    result = retime_run(log_path, policy, scenario=scenario, params=params)
    start = next(LogReader(log_path).events(to_seq=0))
    before = recorded_hours(log_path)
    out = {"log": str(log_path), "recorded_policy": getattr(start, "policy", None),
           "recorded_hours": round(before, 4), "speedup": round(before / result.hours, 4)}
    summary = result.to_dict()
    out.update({key: summary[key] for key in (
        "policy", "hours", "steps", "executions", "lower_bound_hours", "ratio_to_lower_bound", "utilization",
        "role_switches", "redirects")})
    return out
