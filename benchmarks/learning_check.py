"""Learning check: does `gyre train` raise the reward beyond run-to-run noise?

For each seed, a fresh run of the tiny model on the toy `hello` task; the figure is the mean reward of the
last 3 steps minus that of the first 3. The check passes when the mean rise over seeds exceeds the spread
of the per-seed first-3 means (the run-to-run noise of the starting point) and every seed rises.

    python benchmarks/learning_check.py --seeds 1 2 3 --steps 10 --json
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from gyre.config import RolloutSection, SamplingSection, TrainConfig, TrainerSection
from gyre.train.inprocess import TrainingRun


def learning_config(seed: int, steps: int, run_dir: Path) -> TrainConfig:
    return TrainConfig(
        name=f"learning-check-s{seed}", run_dir=run_dir, seed=seed, steps=steps,
        rollout=RolloutSection(task_ids=("hello",), groups_per_step=1, group_size=8, max_concurrency=4,
                               timeout_s=60),
        sampling=SamplingSection(max_tokens=24),
        trainer=TrainerSection(lr=2e-3, eps_low=0.2, eps_high=0.28),
    )


def run(seeds: list[int], steps: int, root: Path) -> dict:
    per_seed = {}
    for seed in seeds:
        started = time.monotonic()
        summary = TrainingRun(learning_config(seed, steps, root / f"seed{seed}")).run()
        rewards = [r.reward_mean for r in summary.steps]
        first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
        per_seed[seed] = {"rewards": [round(r, 4) for r in rewards], "first3": first, "last3": last,
                          "rise": last - first, "seconds": time.monotonic() - started}
    firsts = [s["first3"] for s in per_seed.values()]
    rises = [s["rise"] for s in per_seed.values()]
    spread = max(firsts) - min(firsts)
    return {"seeds": seeds, "steps": steps, "per_seed": per_seed, "mean_rise": statistics.mean(rises),
            "start_spread": spread, "every_seed_rises": all(r > 0 for r in rises),
            "passed": statistics.mean(rises) > spread and all(r > 0 for r in rises)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-learning-") as root:
        result = run(args.seeds, args.steps, Path(root))
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
