"""Simulator benchmark: a paper-scale run (192 nodes, 48 steps) must take under 10 s of CPU.

    .venv/bin/python benchmarks/sim_bench.py [--scenario seed-2.4t] [--json]

Times each policy with its log written to a temporary directory (what ``gyre sim --log`` does) and
without a log, then the exact replay of the elastic log. CPU time is process time (this process only).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from gyre.replay.exact import replay_decisions
from gyre.sim.runner import COMPARED, simulate
from gyre.sim.scenario import load_scenario

BUDGET_CPU_S = 10.0


def timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="seed-2.4t")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    scenario = load_scenario(args.scenario)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for policy in COMPARED:
            log = Path(tmp) / policy
            result, cpu, wall = timed(lambda p=policy, d=log: simulate(scenario, p, log_dir=d))
            _, cpu_nolog, _ = timed(lambda p=policy: simulate(scenario, p))
            log_mb = sum(f.stat().st_size for f in log.iterdir()) / 2**20
            rows.append({"policy": policy, "hours": round(result.hours, 2), "cpu_s": round(cpu, 2),
                         "wall_s": round(wall, 2), "cpu_s_without_log": round(cpu_nolog, 2),
                         "log_mb": round(log_mb, 1), "within_budget": cpu < BUDGET_CPU_S})
        report, cpu, wall = timed(lambda: replay_decisions(Path(tmp) / "elastic"))
        replay_row = {"replay": "elastic", "decision_points": report.decision_points,
                      "mismatches": len(report.mismatches), "cpu_s": round(cpu, 2), "wall_s": round(wall, 2)}
    out = {"scenario": scenario.name, "steps": scenario.steps,
           "nodes": scenario.cluster.cells * scenario.cluster.nodes_per_cell, "runs": rows, "replay": replay_row}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{scenario.name}: {out['nodes']} nodes, {scenario.steps} steps (budget {BUDGET_CPU_S:.0f} s CPU per run)")
    for r in rows:
        print(f"  {r['policy']:9s} {r['hours']:7.2f} h simulated in {r['cpu_s']:5.2f} s CPU "
              f"({r['wall_s']:5.2f} s wall) with its {r['log_mb']:.0f} MB log, {r['cpu_s_without_log']:5.2f} s without")
    print(f"  replay of the elastic log: {replay_row['decision_points']} decision points, "
          f"{replay_row['mismatches']} mismatches, {replay_row['cpu_s']:.2f} s CPU")


if __name__ == "__main__":
    main()
