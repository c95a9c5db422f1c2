"""The fast learning check (#29), the one `make test` runs (tests/sft/test_learning_gain.py): a warm start
that takes the right answer about as often as the expert's slip, then RL with the reward and RL with the rewards
shuffled within each group (same steps, same rollouts, no signal). The reward must move the policy toward the
right answer; the shuffled control must not.

    python -m benchmarks.learning_gain --seeds 1 2 3 --json            # ~4 min a seed on 2 cores
    python -m benchmarks.learning_gain --seeds 1 --sft-seed 2 --json   # another warm start

What is measured: the **answer share** — at the ``write_file`` turn of each task's expert conversation, the
probability the policy gives the right answer's turn over the right answer's plus the slip's (teacher-forced,
`answer_share`). It is what the pass/fail reward pays for and nothing else: a policy that writes the right
answer more often than the slip has a higher share, whatever happens to its tool-call format. The sampled pass
rate is the full check's measure (`benchmarks/warm_start_check.py`); at this size (2 tasks, 8 steps) it is
too noisy to gate a test on, the share is exact for the weights the run ends with.

The setting, chosen so the check is fast and its signal large: two copy tasks (the slip drops the last
letter: a one-token decision); the expert slips in half its demonstrations, so the warm start's share is near
0.5 and a group of 8 holds both outcomes (the largest advantage spread); a 2-layer, width-128 Qwen2 (the
smallest that learned the tool-call format in ~1 min of SFT); 8 steps of 32 rollouts at lr 3e-4 with the
pass/fail reward (examples/learn-cpu.toml's trainer otherwise). docs/benchmarks.md has the per-seed figures.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gyre.config import TrainConfig
from gyre.model.tiny import load_tiny
from gyre.sft.expert import Expert, answer_call, answer_turn, family_tasks, mistake
from gyre.sft.run import SftConfig, run_sft
from gyre.train.inprocess import TrainingRun
from gyre.trainer.export import export_policy

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "learn-cpu.toml"
TRAIN = REPO / "tasks" / "toy" / "learn-train.toml"
TASKS = ("train-copy-input-0", "train-copy-word-0")
ERROR_RATE = 0.5
DEMOS_PER_TASK = 64
SFT = {"steps": 300, "lr": 3e-3, "batch_size": 8, "checkpoint_every": 1000,
       "model": {"hidden_size": 128, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate_size": 512,
                 "context": 2048}}
RL = {"steps": 8, "rollout.groups_per_step": 4, "rollout.group_size": 8, "trainer.lr": 3e-4,
      "evaluation.every": 0, "observe.report": False}


def warm_start(root: Path, seed: int = 0) -> Path:
    """The SFT checkpoint: ``DEMOS_PER_TASK`` demonstrations of each of ``TASKS``, half of them slipping."""
    root.mkdir(parents=True, exist_ok=True)
    demos = root / "demos.jsonl"
    expert = Expert(error_rate=ERROR_RATE, seed=seed)
    with demos.open("w") as f:
        for task in (t for t in family_tasks(TRAIN) if t.id in TASKS):
            for _ in range(DEMOS_PER_TASK):
                f.write(json.dumps(expert.demonstrate(task)) + "\n")
    config = SftConfig.model_validate({**SFT, "run_dir": root / "sft", "seed": seed,
                                       "demonstrations": {"path": demos}})
    return run_sft(config)


def reinforce(model: Path, root: Path, seed: int, *, shuffle_rewards: bool) -> Path:
    """RL from ``model`` on ``TASKS``; the exported policy's directory."""
    name = f"{seed}{'-shuffled' if shuffle_rewards else ''}"
    run_dir = root / f"rl-{name}"
    config = TrainConfig.load(CONFIG, {**RL, "seed": seed, "run_dir": str(run_dir), "engine.model": str(model),
                                       "rollout.task_ids": list(TASKS),
                                       "trajectory.shuffle_rewards": shuffle_rewards})
    TrainingRun(config).run()
    out = root / f"policy-{name}"
    export_policy(run_dir, out)
    return out


def answer_share(model: Path, tasks: tuple[str, ...] = TASKS) -> float:
    """Mean over ``tasks`` of p(right write_file turn) / (p(right) + p(the expert's slip)), teacher-forced
    after the expert's own read_file turns and their real results."""
    torch.set_num_threads(1)
    policy, tokenizer = load_tiny(model)
    policy.eval()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    expert = Expert(error_rate=0.0, skip_check_rate=1.0)
    shares = []
    for task in (t for t in family_tasks(TRAIN) if t.id in tasks):
        record = expert.demonstrate(task)
        messages, tools = record["messages"], record["tools"]
        turn = answer_turn(messages)
        prefix = tokenizer.apply_chat_template(messages[:turn], tools=tools, tokenize=True,
                                               add_generation_prompt=True, return_dict=False)
        logps = []
        for answer in (task.solution, mistake(task, random.Random(0))):
            name, arguments = answer_call(task, answer)
            call = {**messages[turn]["tool_calls"][0], "function": {"name": name, "arguments": json.dumps(arguments)}}
            full = tokenizer.apply_chat_template([*messages[:turn], {**messages[turn], "tool_calls": [call]}],
                                                 tools=tools, tokenize=True, return_dict=False)
            if full[:len(prefix)] != prefix:
                raise ValueError(f"{model}: the chat template renders the turn's prefix differently")
            full = full[:full.index(end, len(prefix)) + 1]  # the turn up to its end, not the template's tail
            ids = torch.tensor([full])
            with torch.no_grad():
                logits = policy(ids).logits[0, :-1].float()
            token_logps = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
            logps.append(float(token_logps[len(prefix) - 1:].sum()))
        right, slip = logps
        shares.append(1 / (1 + math.exp(slip - right)))
    return statistics.mean(shares)


def check(root: Path, seeds: list[int], sft_seed: int = 0) -> dict[str, Any]:
    """The warm start's share, then per RL seed the share after RL with the reward and with it shuffled."""
    started = time.monotonic()
    model = warm_start(root / "warm", sft_seed)
    warm = answer_share(model)
    out: dict[str, Any] = {"sft_seed": sft_seed, "warm_share": round(warm, 4),
                           "warm_s": round(time.monotonic() - started, 1), "per_seed": {}}
    for seed in seeds:
        row: dict[str, Any] = {}
        for shuffle in (False, True):
            started = time.monotonic()
            share = answer_share(reinforce(model, root, seed, shuffle_rewards=shuffle))
            name = "shuffled" if shuffle else "reward"
            row |= {f"{name}_share": round(share, 4), f"{name}_gain": round(share - warm, 4),
                    f"{name}_s": round(time.monotonic() - started, 1)}
        row["reward_minus_shuffled"] = round(row["reward_share"] - row["shuffled_share"], 4)
        out["per_seed"][seed] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--sft-seed", type=int, default=0)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gyre-gain-") as tmp:
        result = check(args.keep or Path(tmp), args.seeds, args.sft_seed)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
