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

With ``--emulate SCENARIO`` every run instead faces the scenario's emulated cluster and workload
(`gyre run --emulate`, `gyre.cluster.emulated`): each cell is its own emulated accelerator, so a cell's
idleness frees capacity as it would on GPUs. The designs are the ablation's best, chosen by the simulator on
the same workload (`gyre.sim.runner.ablate`): elastic (elastic/2), elastic/3 (its ablation row: the parameter
rule of ``docs/scheduler.md``), colocate's best, async's best split, and with ``--partial`` each one's best
with partial rollouts. ``--policies`` names designs by policy, or by version for a version other than the
current one (``elastic,elastic/3,colocate,async``). Each row then carries ``emulated_s`` (wall x
time_scale), the simulator's ``predicted_s`` for the same executions under the same parameters, their
``sim_error``, and whether the emulation held (``emulation_valid``: real compute stayed within its emulated
time). Rankings live and simulated are compared at the end.

    .venv/bin/python -m benchmarks.cluster_compare --emulate seed-2.4t-scaled --time-scale 10 \
        --token-scale 100 --steps 2 --json
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
from gyre.sim.runner import ablate

POLICIES = ("elastic", "colocate", "async")
"""Designs without ``--emulate``."""
DESIGNS = ("elastic", "elastic/3", "colocate", "async")
"""Designs with ``--emulate``: a policy, or a version other than its current one."""

_WINDOW = """
SELECT epoch(min(ts) FILTER (WHERE kind = 'execution_queued')),
       epoch(max(ts) FILTER (WHERE kind = 'weights_published')) FROM events
"""
_ROLLOUT_BUSY = """
SELECT sum(epoch(f.ts) - epoch(s.ts)) / any_value(c.slots)
FROM executions_started s JOIN executions_finished f USING (execution_id) JOIN cells c ON c.cell_id = s.cell_id
"""


def measure(log: Path, policy: str, *, retime: bool = True) -> dict[str, Any]:
    con = LogReader(log).duckdb()
    start, end = con.execute(_WINDOW).fetchone()
    wall = float(end - start)
    cells, slots = con.execute("SELECT count(*), max(slots) FROM cells").fetchone()
    rollout_busy = float(con.execute(_ROLLOUT_BUSY).fetchone()[0] or 0.0)
    training_busy = float(con.execute("SELECT coalesce(sum(duration_s), 0) FROM micro_steps").fetchone()[0])
    switches = con.execute("SELECT count(*) FROM role_switches").fetchone()[0]
    steps = con.execute("SELECT count(*) FROM train_steps").fetchone()[0]
    redirected = con.execute("SELECT coalesce(sum(redirected_calls), 0) FROM role_switches").fetchone()[0]
    out = {"policy": policy, "wall_s": round(wall, 2), "per_step_s": round(wall / max(steps, 1), 2),
           "idle_share": round(1 - (rollout_busy + training_busy) / (cells * wall), 4), "switches": switches,
           "redirected_calls": int(redirected), "steps": steps, "cells": cells, "slots": slots}
    if retime:  # the counterfactual: the recorded executions re-timed by the simulator under this policy
        predicted = retime_run(log, policy).hours * 3600
        out |= {"predicted_s": round(predicted, 2), "sim_error": round(predicted / wall - 1, 4)}
    return out


def emulated_designs(scenario_name: str, steps: int | None, partial: bool) -> list[dict[str, Any]]:
    """The designs to run live, each the simulator's best of its kind on the same workload, with the
    simulator's hours for it (the ablation's rows: the same seed, executions and parameters), timed call by
    call as the live run plays them (`gyre.cluster.emulated.played`)."""
    from gyre.cluster.emulated import played

    result = ablate(played(scenario_name), steps=steps)
    rows = {r["variant"]: r for r in result["runs"]}
    chosen = ["elastic", "elastic/3", result["best_colocate"], result["best_async"]]
    if partial:
        chosen += [result["partial_rollouts"][f"best_{d}"] for d in ("elastic", "colocate", "async")]
        chosen.insert(5, result["elastic3"]["best"])
    return [rows[name] for name in chosen]


def design_policy(design: dict[str, Any]) -> tuple[str, str | None, str]:
    """An ablation row's policy, its version where that is not the policy's current one, and the name
    ``--policies`` knows it by (the version, or the policy)."""
    from gyre.scheduler import get_policy

    version = design["policy_version"]
    name = version.split("/")[0]
    if get_policy(name).version == version:  # an unknown name fails here, before any process starts
        return name, None, name
    return name, version, version


def compare_emulated(base: ClusterConfig, args: argparse.Namespace) -> dict[str, Any]:
    """One live emulated run per design (module docstring), each beside the simulator's prediction."""
    from gyre.cluster.emulated import scenario_overrides

    results = []
    wanted = set(args.policies.split(","))
    for design in emulated_designs(args.emulate, args.steps, args.partial):
        policy, version, key = design_policy(design)
        if key not in wanted:  # --policies: a subset of the designs (each run is independent)
            continue
        params = dict(design["params"])
        params.pop("staleness", None)
        run_dir = args.out / "".join(c for c in design["variant"].replace(" ", "_") if c not in ",()/")
        shutil.rmtree(run_dir, ignore_errors=True)
        scheduler = {"scheduler.policy": policy, "scheduler.version": version}
        staged = base.model_copy(update={"run_dir": run_dir, "scheduler": base.scheduler.model_copy(
            update={"policy": policy, "version": version})})
        overrides = scenario_overrides(staged, args.emulate, time_scale=args.time_scale,
                                       token_scale=args.token_scale, params=params)
        if args.steps is not None:
            overrides["steps"] = args.steps
        config = ClusterConfig.load(args.config, {**overrides, "run_dir": str(run_dir), **scheduler})
        summary = ClusterRun(config).run()
        if summary.status != "completed":
            raise SystemExit(f"the {design['variant']} run did not complete: {summary.status}")
        live = measure(summary.log, policy, retime=False)
        emulated_s = live["wall_s"] * args.time_scale
        predicted_s = design["hours"] * 3600
        row = {"design": design["variant"], **live, "emulated_s": round(emulated_s, 1),
               "predicted_s": round(predicted_s, 1), "sim_error": round(predicted_s / emulated_s - 1, 4),
               "emulation": summary.emulation,
               "emulation_valid": bool(summary.emulation and summary.emulation.get("valid"))}
        results.append(row)
        if not args.json:
            print(json.dumps(row))
    live_rank = [r["design"] for r in sorted(results, key=lambda r: r["emulated_s"])]
    sim_rank = [r["design"] for r in sorted(results, key=lambda r: r["predicted_s"])]
    return {"benchmark": "cluster_compare", "emulate": args.emulate, "time_scale": args.time_scale,
            "token_scale": args.token_scale, "steps": args.steps, "config": str(args.config),
            "machine": f"{platform.machine()}, {platform.node()}", "results": results,
            "rank_live": live_rank, "rank_sim": sim_rank, "same_ranking": live_rank == sim_rank,
            "max_abs_sim_error": max(abs(r["sim_error"]) for r in results),
            "all_valid": all(r["emulation_valid"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("examples/cluster-cpu.toml"))
    parser.add_argument("--steps", type=int, default=None, help="train steps (default 3; --emulate: the "
                                                                 "scenario's)")
    parser.add_argument("--out", type=Path, default=Path("runs/compare"))
    parser.add_argument("--policies", default=None, help=f"which designs to run (default {','.join(POLICIES)}; "
                                                          f"with --emulate {','.join(DESIGNS)})")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--emulate", default=None, help="a scenario (replay/scenarios name or file): see above")
    parser.add_argument("--time-scale", type=float, default=10.0, help="with --emulate: emulated s per wall s")
    parser.add_argument("--token-scale", type=float, default=100.0, help="with --emulate: tokens per real token")
    parser.add_argument("--partial", action="store_true", help="with --emulate: also each design's best with "
                                                                 "partial rollouts")
    args = parser.parse_args()
    base = ClusterConfig.load(args.config)
    args.policies = args.policies or ",".join(DESIGNS if args.emulate is not None else POLICIES)
    if args.emulate is not None:
        print(json.dumps(compare_emulated(base, args), indent=None if args.json else 2))
        return
    args.steps = args.steps or 3
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
