"""A short emulated run agrees with `gyre sim`: 4 cells facing a small cut of `seed-2.4t-scaled` (8 groups of
2, 2 steps) on emulated accelerators, streamed elastic. The live run's emulated time (first queued to last
published, times ``time_scale``) must be within ``TOLERANCE`` of the simulator's prediction for the same
workload, policy and parameters; its executions must be multi-call and make the workload's calls with the
workload's tokens (real counts times ``token_scale``).

The tolerance is wider than the 0.2% the 8-cell run measured at ``time_scale`` 10 (`docs/benchmarks.md`,
"Whole rows in the simulator"): to fit in `make test` this run compresses time fivefold more, and every real
overhead the simulator does not have (a harness's start-up, a role switch's real work) is multiplied by
``time_scale`` (measured: −11% at load 7). What the test guards is that the two stay the same model: a lost
mechanism on either side costs tens of per cent (the earlier −35% without streaming, −55% for async trained on
its core alone)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gyre.cluster.config import ClusterConfig
from gyre.cluster.emulated import measure, scenario_overrides
from gyre.cluster.run import ClusterRun
from gyre.log import LogReader
from gyre.sim.calls import CallTiming, plan_calls
from gyre.sim.scenario import load_scenario
from gyre.sim.workload import sample_workload

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TIME_SCALE, TOKEN_SCALE, TOLERANCE = 50.0, 200.0, 0.15


def small_scenario(directory: Path) -> Path:
    """`seed-2.4t-scaled` on 4 cells with 8 groups a step, for 2 steps (async's split halved with the cells)."""
    text = (REPO / "replay" / "scenarios" / "seed-2.4t-scaled.toml").read_text()
    for old, new in (('name = "seed-2.4t-scaled"', 'name = "seed-2.4t-4cells"'), ("steps = 12", "steps = 2"),
                     ("cells = 8", "cells = 4"), ("groups = 16", "groups = 8"),
                     ("training_cells = 4", "training_cells = 2")):
        assert old in text, old
        text = text.replace(old, new, 1)
    path = directory / "seed-2.4t-4cells.toml"
    path.write_text(text)
    return path


def test_a_short_emulated_run_agrees_with_the_simulator_call_by_call(tmp_path: Path) -> None:
    scenario_file = small_scenario(tmp_path)
    run_dir = tmp_path / "run"
    example = REPO / "examples" / "cluster-cpu.toml"
    base = ClusterConfig.load(example, {"run_dir": str(run_dir), "scheduler.policy": "elastic"})
    overrides = scenario_overrides(base, str(scenario_file), time_scale=TIME_SCALE, token_scale=TOKEN_SCALE)
    config = ClusterConfig.load(example, {**overrides, "run_dir": str(run_dir), "scheduler.policy": "elastic",
                                          "cluster.start_timeout_s": 900})
    summary = ClusterRun(config).run()
    assert summary.status == "completed"
    assert summary.emulation and summary.emulation["valid"], f"real compute overran the emulation: {summary.emulation}"

    agreement = measure(run_dir)
    assert abs(agreement["sim_error"]) <= TOLERANCE, json.dumps(agreement)

    scenario = load_scenario(str(scenario_file))
    timing = CallTiming(scenario)
    plans = {e.execution_id: plan_calls(scenario, e, scenario.seed, timing)
             for e in sample_workload(scenario, scenario.seed).executions()}
    con = LogReader(summary.log).duckdb()
    rows = con.execute("""
        SELECT f.execution_id, count(c.call_id), sum(len(c.prompt_delta_ids)), sum(len(c.output_ids))
        FROM executions_finished f JOIN model_calls c USING (execution_id)
        WHERE f.status = 'completed' GROUP BY ALL""").fetchall()
    assert len(rows) >= 16
    planned_tokens = real_tokens = 0
    for execution_id, calls, prompt, output in rows:
        step, group, rollout = (int(x) for x in re.search(r"s(\d+)-g(\d+)-e(\d+)$", execution_id).groups())
        plan = plans[f"s{step:03d}-g{group:03d}-r{rollout:02d}"]
        assert calls == len(plan.calls) > 1  # multi-call, exactly the workload's calls
        planned_tokens += sum(c.prompt_delta_tokens + c.output_tokens for c in plan.calls)
        real_tokens += (prompt + output) * TOKEN_SCALE
    assert real_tokens == pytest.approx(planned_tokens, rel=0.05)  # the chat template included
