"""Emulated live runs against the simulator, step by step: what streaming micro-steps buy live.

    .venv/bin/python -m benchmarks.stream_live RUN_DIR [RUN_DIR ...]

Each RUN_DIR is a finished `gyre run CONFIG --emulate SCENARIO` run. Per run (folded from its log and its
``cluster-config.json``): ``emulated_s`` = first `execution_queued` to last `weights_published` (the window of
``benchmarks.cluster_compare``) times the run's ``time_scale``; per step, when it opened, when its last reward
came and when it finished (emulated seconds from the first queueing); and ``predicted_s``, ``gyre sim`` on
the same scenario and steps with the run's policy and the parameters a policy decides by (streaming,
partial rollouts, hysteresis, staleness), with ``sim_error`` = predicted / live - 1. JSON on stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gyre.log import LogReader
from gyre.sim.runner import simulate
from gyre.sim.scenario import load_scenario, with_policy_values

COMPARED_PARAMS = ("stream_micro_steps", "partial_rollouts", "oversample_groups", "hysteresis_slots")
"""The run's policy parameters the prediction takes (switch and join times are the scenario's, unscaled)."""

_STEPS = """
SELECT s.step, s.planned_micro_steps, epoch(s.ts) AS opened, epoch(f.ts) AS finished,
       (SELECT epoch(max(r.ts)) FROM rewards r JOIN executions_queued q USING (execution_id)
        WHERE q.step = s.step) AS last_reward
FROM train_steps_started s JOIN train_steps f USING (step) ORDER BY s.step
"""


def measure(run_dir: Path) -> dict[str, Any]:
    config = json.loads((run_dir / "cluster-config.json").read_text())
    emulate = config["emulate"]
    scale = float(emulate["time_scale"])
    con = LogReader(run_dir / "log").duckdb()
    start, end = con.execute("SELECT epoch(min(ts)) FROM executions_queued").fetchone()[0], \
        con.execute("SELECT epoch(max(ts)) FROM weights_published").fetchone()[0]
    policy, raw = con.execute("SELECT policy, policy_params FROM runs_started").fetchone()
    params = json.loads(raw)
    steps = [{"step": step, "planned_micro_steps": planned, "opened_s": round((opened - start) * scale, 1),
              "last_reward_s": round((last - start) * scale, 1), "finished_s": round((done - start) * scale, 1)}
             for step, planned, opened, done, last in con.execute(_STEPS).fetchall()]
    scenario = with_policy_values(load_scenario(emulate["scenario"]), {
        "staleness": params.get("staleness", 0),
        **{f"{policy}.{k}": params[k] for k in COMPARED_PARAMS if k in params}})
    predicted = simulate(scenario, policy, steps=len(steps)).hours * 3600
    live = (end - start) * scale
    return {"run_dir": str(run_dir), "scenario": emulate["scenario"], "policy": policy, "time_scale": scale,
            "params": {k: params[k] for k in COMPARED_PARAMS if k in params}, "wall_s": round(end - start, 1),
            "emulated_s": round(live, 1), "predicted_s": round(predicted, 1),
            "sim_error": round(predicted / live - 1, 4), "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories of finished --emulate runs")
    args = parser.parse_args()
    print(json.dumps({"runs": [measure(r) for r in args.runs]}, indent=2))


if __name__ == "__main__":
    main()
