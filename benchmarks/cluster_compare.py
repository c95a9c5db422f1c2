"""Live comparison: the same heavy-tailed workload under elastic, colocate and async on a CPU cluster.

    .venv/bin/python -m benchmarks.cluster_compare [--config examples/cluster-cpu.toml] [--steps 3] [--json]

Each policy runs the config's cells (processes), staleness and workload — the toy agent with a seeded
heavy-tailed environment (`agents/toy_agent/harness-tailed.toml`) — into its own run directory. Figures, all
folded from each run's log:
- ``wall_s``: first `execution_queued` to last `weights_published` (process start-up left out: it is the
  same for every policy and not what a scheduler changes); ``per_step_s`` = wall / steps;
- ``idle_share``: 1 - busy cell-seconds / (cells x wall), where a rollout cell is busy in proportion to the
  slots its executions hold (execution start to finish, on the cell it started on) and a training cell for
  the duration of the micro-steps it ran;
- ``switches``: role switches completed;
- ``predicted_s``: the simulator's prediction for the same recorded workload under the same policy
  (counterfactual replay, `gyre.replay.counterfactual.retime_run`, costs measured from the log), and
  ``sim_error`` = predicted / measured - 1.
The cells share two cores, so training competes with the rollouts' engines for CPU; harnesses waiting on
their environment use none, which is the capacity elastic lends.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
from pathlib import Path
from typing import Any

from gyre.cluster.config import ClusterConfig
from gyre.cluster.run import ClusterRun
from gyre.log import LogReader
from gyre.replay.counterfactual import retime_run

POLICIES = ("elastic", "colocate", "async")

_WINDOW = """
SELECT epoch(min(ts) FILTER (WHERE kind = 'execution_queued')),
       epoch(max(ts) FILTER (WHERE kind = 'weights_published')) FROM events
"""
_ROLLOUT_BUSY = """
SELECT sum(epoch(f.ts) - epoch(s.ts)) / any_value(c.slots)
FROM executions_started s JOIN executions_finished f USING (execution_id) JOIN cells c ON c.cell_id = s.cell_id
"""


def measure(log: Path, policy: str) -> dict[str, Any]:
    con = LogReader(log).duckdb()
    start, end = con.execute(_WINDOW).fetchone()
    wall = float(end - start)
    cells, slots = con.execute("SELECT count(*), max(slots) FROM cells").fetchone()
    rollout_busy = float(con.execute(_ROLLOUT_BUSY).fetchone()[0] or 0.0)
    training_busy = float(con.execute("SELECT coalesce(sum(duration_s), 0) FROM micro_steps").fetchone()[0])
    switches = con.execute("SELECT count(*) FROM role_switches").fetchone()[0]
    steps = con.execute("SELECT count(*) FROM train_steps").fetchone()[0]
    predicted = retime_run(log, policy).hours * 3600
    return {"policy": policy, "wall_s": round(wall, 2), "per_step_s": round(wall / max(steps, 1), 2),
            "idle_share": round(1 - (rollout_busy + training_busy) / (cells * wall), 4), "switches": switches,
            "steps": steps, "cells": cells, "slots": slots, "predicted_s": round(predicted, 2),
            "sim_error": round(predicted / wall - 1, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("examples/cluster-cpu.toml"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/compare"))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = ClusterConfig.load(args.config)
    results = []
    for policy in args.policies.split(","):
        run_dir = args.out / policy
        shutil.rmtree(run_dir, ignore_errors=True)
        scheduler = base.scheduler.model_copy(update={"policy": policy,
                                                      "params": base.scheduler.params if policy == "elastic" else {}})
        config = base.model_copy(update={"run_dir": run_dir, "steps": args.steps, "scheduler": scheduler})
        summary = ClusterRun(config).run()
        if summary.status != "completed":
            raise SystemExit(f"the {policy} run did not complete: {summary.status}")
        results.append(measure(summary.log, policy))
        if not args.json:
            print(json.dumps(results[-1]))
    by = {r["policy"]: r for r in results}
    out = {"benchmark": "cluster_compare", "config": str(args.config), "steps": args.steps,
           "machine": f"{platform.machine()}, {platform.node()}", "results": results}
    if "elastic" in by:
        out["elastic_speedup"] = {p: round(r["wall_s"] / by["elastic"]["wall_s"], 3) for p, r in by.items()}
    print(json.dumps(out, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
