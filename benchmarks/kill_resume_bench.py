"""kill -9 / resume torture at more points than `make test` runs (tests/controller/test_kill_resume.py).

    python benchmarks/kill_resume_bench.py --points 60 --steps 12 --seed 1 --json
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

from gyre.config import CheckpointSection, RolloutSection, SamplingSection, TrainConfig, TrainerSection
from gyre.train.crash import torture

QUICK = Path(__file__).resolve().parents[1] / "tests" / "controller" / "quick"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--points", type=int, default=60)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-kill-") as root:
        config = TrainConfig(
            name="kill-bench", run_dir=Path(root) / "run", seed=args.seed, steps=args.steps,
            rollout=RolloutSection(tasks=QUICK / "tasks.toml", harness=QUICK / "harness.toml", task_ids=("hello",),
                                   groups_per_step=1, group_size=2, max_concurrency=2, timeout_s=30),
            sampling=SamplingSection(max_tokens=8), trainer=TrainerSection(lr=1e-3, eps_low=0.2, eps_high=0.28),
            checkpoint=CheckpointSection(every_steps=2))
        started = time.monotonic()
        report = torture(config, points=args.points, seed=args.seed, children=args.points * 3)
        seconds = time.monotonic() - started
    kinds: dict[str, int] = {}
    for kind, _ in report.kill_points:
        kinds[kind] = kinds.get(kind, 0) + 1
    result = {"points": len(report.kill_points), "killed_on": kinds, "resumes": report.resumes, "steps": args.steps,
              "executions": report.executions, "rewards": report.rewards, "versions": report.versions,
              "retrained_steps": report.retrained,
              "problems": report.problems, "passed": report.ok, "seconds": round(seconds, 1)}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
