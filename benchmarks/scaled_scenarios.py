"""Scaled scenarios beside their originals: the three designs on each, and whether the scaled one keeps the
original's policy ranking and speedups within 5% (issue #26, deliverable 5).

    .venv/bin/python benchmarks/scaled_scenarios.py [--pair seed-2.4t] [--seed 0] [--per-call] [--json]

Each pair is simulated in full (``compare``: elastic, colocate and async on the same work, every cost on).
``--per-call`` times both scenarios call by call (``calls.simulate``). JSON out: ``{"tolerance", "pairs"}``, a
pair with both runs' hours, speedups and rankings, the scaled/original ratio of each speedup and the verdict.
"""

import argparse
import json
import time
from typing import Any

from gyre.sim.runner import compare
from gyre.sim.scenario import load_scenario, with_values

PAIRS = {"seed-2.4t": "seed-2.4t-scaled", "terminal-bench-like": "terminal-bench-like-scaled"}
TOLERANCE = 0.05


def ranking(run: dict[str, Any]) -> list[str]:
    return [p["policy"] for p in sorted(run["policies"], key=lambda p: p["hours"])]


def side_by_side(original: str, scaled: str, seed: int | None, per_call: bool) -> dict[str, Any]:
    runs, cpu = {}, {}
    for name in (original, scaled):
        scenario = load_scenario(name)
        if per_call:
            scenario = with_values(scenario, {"calls.simulate": True})
        start = time.process_time()
        runs[name] = compare(scenario, seed=seed)
        cpu[name] = round(time.process_time() - start, 1)
    a, b = runs[original], runs[scaled]
    ratios = {key: round(b[key] / a[key], 4) for key in ("speedup_vs_colocate", "speedup_vs_async")}
    same_ranking = ranking(a) == ranking(b)
    return {
        "original": original, "scaled": scaled, "seed": a["seed"], "per_call": per_call,
        "steps": {original: a["steps"], scaled: b["steps"]}, "cpu_s": cpu,
        "hours": {name: {p["policy"]: round(p["hours"], 3) for p in run["policies"]} for name, run in runs.items()},
        "speedup_vs_colocate": {original: a["speedup_vs_colocate"], scaled: b["speedup_vs_colocate"]},
        "speedup_vs_async": {original: a["speedup_vs_async"], scaled: b["speedup_vs_async"]},
        "ranking": {original: ranking(a), scaled: ranking(b)}, "scaled_over_original": ratios,
        "same_ranking": same_ranking,
        "within_tolerance": same_ranking and all(abs(r - 1) <= TOLERANCE for r in ratios.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", action="append", choices=sorted(PAIRS), help="original scenario (default: all)")
    parser.add_argument("--seed", type=int, default=None, help="workload seed (default: the scenarios')")
    parser.add_argument("--per-call", action="store_true", help="time both scenarios call by call")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = [side_by_side(o, PAIRS[o], args.seed, args.per_call) for o in (args.pair or sorted(PAIRS))]
    if args.json:
        print(json.dumps({"tolerance": TOLERANCE, "pairs": out}))
        return
    for row in out:
        o, s = row["original"], row["scaled"]
        print(f"{o} ({row['steps'][o]} steps) vs {s} ({row['steps'][s]} steps), seed {row['seed']}:")
        for name in (o, s):
            h = row["hours"][name]
            print(f"  {name:28} elastic {h['elastic']:8.2f} h  colocate {h['colocate']:8.2f} h  "
                  f"async {h['async']:8.2f} h"
                  f"  x colocate {row['speedup_vs_colocate'][name]:.3f}  x async {row['speedup_vs_async'][name]:.3f}")
        print(f"  scaled / original: {row['scaled_over_original']}  same ranking: {row['same_ranking']}  "
              f"within {TOLERANCE:.0%}: {row['within_tolerance']}")


if __name__ == "__main__":
    main()
