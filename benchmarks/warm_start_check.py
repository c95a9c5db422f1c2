"""Warm-start learning check (#29): RL from the SFT checkpoint on the task families' training split, with the
held-out pass@1 every few steps, training reward and model calls / tool calls per execution per step.

    python benchmarks/warm_start_check.py --model runs/learn/sft/model --seeds 1 --steps 10 --json

Each seed is a fresh `gyre train` of examples/learn-cpu.toml (its run directory under a temporary root); calls
per execution come from the toy agent's final JSON line (`harness.stdout`) of each execution.
"""

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from gyre.config import TrainConfig
from gyre.train.inprocess import TrainingRun

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "learn-cpu.toml"


def agent_stats(executions: Path) -> dict[str, dict[str, float]]:
    """Per step (``s0``...) or held-out evaluation (``heldout-s0``...): mean model calls and tool calls."""
    calls: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for stdout in executions.glob("*/harness.stdout"):
        lines = stdout.read_text().strip().splitlines()
        if not lines:
            continue
        result = json.loads(lines[-1])
        name = stdout.parent.name
        key = name.split("-heldout")[0] if name.startswith("heldout-") else name.split(".")[-1].split("-")[0]
        calls[key].append((result.get("model_calls", 0), result.get("tool_calls", 0)))
    return {k: {"executions": len(v), "model_calls": statistics.mean(c for c, _ in v),
                "tool_calls": statistics.mean(t for _, t in v),
                "multi_turn_share": sum(c >= 3 and t >= 2 for c, t in v) / len(v)} for k, v in sorted(calls.items())}


def run_seed(model: str, seed: int, steps: int, every: int, root: Path) -> dict[str, Any]:
    config = TrainConfig.load(CONFIG, {"seed": seed, "steps": steps, "run_dir": str(root / f"seed{seed}"),
                                       "engine.model": model, "evaluation.every": every})
    heldout: dict[int, float | None] = {}

    def progress(kind: str, fields: dict) -> None:
        if kind == "heldout":
            heldout[fields["event"].step] = fields["event"].pass_rate

    started = time.monotonic()
    summary = TrainingRun(config, progress).run()
    return {"heldout_pass_rate": heldout, "rewards": [r.reward_mean for r in summary.steps],
            "agent": agent_stats(config.run_dir / "executions"), "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the SFT checkpoint (gyre sft's RUN_DIR/model)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=5, help="held-out evaluation every N steps")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-warm-") as tmp:
        root = args.keep or Path(tmp)
        result = {"model": args.model, "steps": args.steps,
                  "per_seed": {s: run_seed(args.model, s, args.steps, args.every, root) for s in args.seeds}}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
