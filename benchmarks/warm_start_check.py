"""Warm-start learning check (#29): RL from the SFT checkpoint on the task families' training split, with the
held-out pass@1 (and pass@k with ``--samples k``) every few steps, training reward and model calls / tool calls
per execution per step.

    python benchmarks/warm_start_check.py --model runs/learn/sft/model --seeds 1 --steps 10 --json
    python benchmarks/warm_start_check.py --model runs/learn/sft/model --steps 10 --shuffle-rewards   # control
    python benchmarks/warm_start_check.py --model runs/learn/sft/model --families copy upper reverse concat \
        --set trajectory.reward_threshold=1.0 --set trainer.lr=3e-4    # pass/fail reward, families interleaved
    python benchmarks/warm_start_check.py --model runs/learn/sft/model --probe 4    # a minute: does it copy?
    python benchmarks/warm_start_check.py --model runs/learn/sft/model --warm-start 8   # pass@1, pass@8, calls

Each seed is a fresh `gyre train` of examples/learn-cpu.toml (its run directory under a temporary root, or
``--keep``); rewards per execution come from the run's log (``reward_recorded``), calls per execution from the
toy agent's final JSON line (`harness.stdout`) of each execution. ``--probe K`` runs no RL: it renders each
held-out task up to the model's ``write_file`` turn with the expert's real tool results, samples K
continuations and counts those holding the exact answer (the content skill alone, no harness, no engine).
``--shuffle-rewards`` runs the control of `trajectory.shuffle_rewards` (rewards permuted within each group
before advantages): same steps, same rollouts, no reward signal.
"""

import argparse
import json
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from gyre.config import TrainConfig
from gyre.evaluation.heldout import GROUP_PREFIX
from gyre.log.reader import LogReader
from gyre.train.inprocess import TrainingRun

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "learn-cpu.toml"
HELDOUT = Path(__file__).resolve().parents[1] / "tasks" / "toy" / "learn-heldout.toml"


def agent_stats(executions: Path) -> dict[str, dict[str, float]]:
    """Per step (``s0``...) or held-out evaluation (``heldout-s0``...): mean model calls and tool calls, and the
    share of executions with a malformed tool call (the format RL at too high an lr erodes, #29)."""
    calls: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for stdout in executions.glob("*/harness.stdout"):
        lines = stdout.read_text().strip().splitlines()
        if not lines:
            continue
        result = json.loads(lines[-1])
        name = stdout.parent.name
        key = name.split("-heldout")[0] if name.startswith("heldout-") else name.split(".")[-1].split("-")[0]
        calls[key].append((result.get("model_calls", 0), result.get("tool_calls", 0),
                           result.get("malformed_tool_calls", 0)))
    return {k: {"executions": len(v), "model_calls": round(statistics.mean(c for c, _, _ in v), 3),
                "tool_calls": round(statistics.mean(t for _, t, _ in v), 3),
                "multi_turn_share": round(sum(c >= 3 and t >= 2 for c, t, _ in v) / len(v), 3),
                "malformed_share": round(sum(m > 0 for _, _, m in v) / len(v), 3)}
            for k, v in sorted(calls.items())}


def heldout_passes(log: Path, threshold: float = 1.0, *, pooled: bool = False) -> dict[int, dict[str, Any]]:
    """Per held-out evaluation (by step): pass@1 (mean over samples), pass@k (share of tasks with a pass among
    its k samples) and pass@1 per family, from the log's rewards of the ``heldout-s{step}-{task}-e{i}``
    executions. ``pooled``: every evaluation's samples as one, under step 0 (evaluations of the same weights)."""
    by_step: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for event in LogReader(log).events(kinds=["reward_recorded"]):
        if not event.execution_id.startswith(GROUP_PREFIX):
            continue
        step, rest = event.execution_id.removeprefix(GROUP_PREFIX + "s").split("-", 1)
        by_step[0 if pooled else int(step)][rest.rsplit("-e", 1)[0]].append(event.reward)
    out = {}
    for step, tasks in sorted(by_step.items()):
        passes = {task: [r >= threshold for r in rewards] for task, rewards in tasks.items()}
        families: dict[str, list[bool]] = defaultdict(list)
        for task, p in passes.items():
            families[task.split("-")[1]] += p
        out[step] = {"tasks": len(passes), "samples": max(len(p) for p in passes.values()),
                     "pass@1": round(statistics.mean(x for p in passes.values() for x in p), 4),
                     "pass@k": round(statistics.mean(any(p) for p in passes.values()), 4),
                     "family_pass@1": {f: round(statistics.mean(p), 3) for f, p in sorted(families.items())}}
    return out


def training_passes(log: Path, threshold: float = 1.0) -> list[float]:
    """Per step: the share of its training executions whose graded reward reached ``threshold`` (whatever
    reward the run trained on: with ``trajectory.reward_threshold`` unset the step's reward is graded)."""
    by_step: dict[int, list[bool]] = defaultdict(list)
    for event in LogReader(log).events(kinds=["reward_recorded"]):
        if event.execution_id.startswith(GROUP_PREFIX):
            continue
        by_step[int(event.execution_id.rsplit(".", 1)[-1].split("-")[0].removeprefix("s"))].append(
            event.reward >= threshold)
    return [round(statistics.mean(p), 4) for _, p in sorted(by_step.items())]


def interleaved(families: list[str], tasks: Path) -> list[str]:
    """The training tasks of ``families``, one of each family in turn: a step's groups (which cycle through
    ``rollout.task_ids`` in order) then mix the families instead of training one family for several steps."""
    from gyre.harness.tasks import TaskSet

    by_family: dict[str, list[str]] = {f: [] for f in families}
    for task in TaskSet.load(tasks):
        family = task.id.split("-")[1]
        if family in by_family:
            by_family[family].append(task.id)
    empty = [f for f, ids in by_family.items() if not ids]
    if empty:
        raise SystemExit(f"no training task of family {empty} in {tasks}")
    rounds = max(len(ids) for ids in by_family.values())
    return [ids[i] for i in range(rounds) for ids in by_family.values() if i < len(ids)]


def _written(task: Any, answer: str) -> str:
    """How the call that writes ``answer`` spells it (`answer_call`'s last argument, JSON-encoded)."""
    from gyre.sft.expert import answer_call

    key, value = list(answer_call(task, answer)[1].items())[-1]
    return f'"{key}": {json.dumps(value)}'


def probe(model: str, samples: int, tasks: Path = HELDOUT) -> dict[str, Any]:
    """Share of sampled ``write_file`` turns that write the exact answer, per family (see the module doc), and
    the share that write the expert's slip instead: right + slip is the content skill, right / (right + slip)
    the mode RL moves (a slip it can turn into the answer; anything else it cannot). Also the share of first
    calls that read the file the prompt names (``read_per_family``): a policy that guesses the file fails
    before the answer turn, and RL cannot help where the guess does not depend on the prompt."""
    import torch

    from gyre.model.tiny import load_tiny
    from gyre.sft.expert import Expert, answer_turn, family_tasks, mistake

    torch.set_num_threads(1)
    policy, tokenizer = load_tiny(Path(model))
    policy.eval()
    expert = Expert(error_rate=0.0, skip_check_rate=1.0)
    hits: dict[str, list[float]] = defaultdict(list)
    slips: dict[str, list[float]] = defaultdict(list)
    reads: dict[str, list[float]] = defaultdict(list)

    def sample(ids: Any, seed: int, tokens: int) -> str:
        torch.manual_seed(seed)
        out = policy.generate(ids, max_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0,
                              pad_token_id=tokenizer.pad_token_id)
        return tokenizer.decode(out[0, ids.shape[1]:])

    for task in family_tasks(tasks):
        record = expert.demonstrate(task)
        messages = record["messages"]
        opening = torch.tensor([tokenizer.apply_chat_template(messages[:2], tools=record["tools"], tokenize=True,
                                                              add_generation_prompt=True, return_dict=False)])
        named = f'"path": "{task.inputs[0]}"'
        reads[task.family].append(sum(named in sample(opening, i, 24) for i in range(samples)) / samples)
        turn = answer_turn(messages)
        ids = torch.tensor([tokenizer.apply_chat_template(messages[:turn], tools=record["tools"], tokenize=True,
                                                          add_generation_prompt=True, return_dict=False)])
        wanted, found, slipped = _written(task, task.solution), 0, 0
        slip = {_written(task, mistake(task, random.Random(i))) for i in range(8)} - {wanted}
        for i in range(samples):
            text = sample(ids, i, 64)
            found += wanted in text
            slipped += any(s in text for s in slip)
        hits[task.family].append(found / samples)
        slips[task.family].append(slipped / samples)
    return {"samples": samples, "tasks": sum(map(len, hits.values())),
            "right_content": round(statistics.mean(x for v in hits.values() for x in v), 4),
            "slip_content": round(statistics.mean(x for v in slips.values() for x in v), 4),
            "per_family": {f: round(statistics.mean(v), 3) for f, v in sorted(hits.items())},
            "slip_per_family": {f: round(statistics.mean(v), 3) for f, v in sorted(slips.items())},
            "read_per_family": {f: round(statistics.mean(v), 3) for f, v in sorted(reads.items())}}


# The warm start alone: a run evaluates its initial and its final policy, so one step that changes nothing (a
# negligible lr on two rollouts) gives two evaluations of the same weights, pooled.
WARM_START = {"trainer.lr": 1e-12, "rollout.groups_per_step": 1, "rollout.group_size": 2}


def warm_start(model: str, samples: int, root: Path) -> dict[str, Any]:
    """Held-out pass@1, pass@``samples`` and calls per execution of the warm start itself (no RL)."""
    if samples % 2:
        raise SystemExit(f"--warm-start takes an even number of samples (half per evaluation), got {samples}")
    result = run_seed(model, 0, 1, 1, root, samples=samples // 2, overrides=WARM_START, pooled=True)
    agent = result["agent"]
    evaluations = [v for k, v in agent.items() if k.startswith("heldout")]
    executions = sum(v["executions"] for v in evaluations)
    return {"heldout": result["heldout"][0], "seconds": result["seconds"], "heldout_agent": {
        "executions": executions,
        **{k: round(sum(v[k] * v["executions"] for v in evaluations) / executions, 3)
           for k in ("model_calls", "tool_calls", "multi_turn_share", "malformed_share")}}}


def run_seed(model: str, seed: int, steps: int, every: int, root: Path, *, samples: int = 1,
             shuffle_rewards: bool = False, overrides: dict[str, Any] | None = None,
             pooled: bool = False, resume: bool = False) -> dict[str, Any]:
    """One RL run (``resume``: continue the one ``root`` holds for this seed, if any, from its log)."""
    run_dir = root / f"seed{seed}{'-shuffled' if shuffle_rewards else ''}"
    config = TrainConfig.load(CONFIG, {"seed": seed, "steps": steps, "run_dir": str(run_dir),
                                       "engine.model": model, "evaluation.every": every,
                                       "evaluation.samples": samples, "trajectory.shuffle_rewards": shuffle_rewards,
                                       **(overrides or {})})
    started = time.monotonic()
    summary = TrainingRun(config, resume=resume and (run_dir / "log").exists()).run()
    return {"shuffle_rewards": shuffle_rewards, "heldout": heldout_passes(config.run_dir / "log", pooled=pooled),
            "rewards": [round(r.reward_mean, 4) for r in summary.steps],
            "train_pass": training_passes(config.run_dir / "log"),
            "agent": agent_stats(config.run_dir / "executions"), "seconds": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="the SFT checkpoint (gyre sft's RUN_DIR/model)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--every", type=int, default=5, help="held-out evaluation every N steps")
    parser.add_argument("--samples", type=int, default=1, help="held-out samples per task (pass@k with k of them)")
    parser.add_argument("--shuffle-rewards", action="store_true", help="the control: rewards permuted in groups")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="a config override, e.g. trainer.lr=3e-4 or rollout.groups_per_step=8")
    parser.add_argument("--families", nargs="+", default=None, metavar="FAMILY",
                        help="train only on these families' tasks, interleaved (e.g. copy upper reverse concat)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    parser.add_argument("--resume", action="store_true",
                        help="continue the runs --keep holds (same arguments), e.g. after a kill")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON result here (every mode)")
    parser.add_argument("--probe", type=int, default=0, metavar="K",
                        help="no RL: sample K write_file turns per held-out task and count exact answers")
    parser.add_argument("--warm-start", type=int, default=0, metavar="K",
                        help="no RL: the warm start's held-out pass@1, pass@K and calls per execution (K even)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.probe:
        _emit({"model": args.model, **probe(args.model, args.probe)}, args.out, compact=True)
        return
    if args.warm_start:
        with tempfile.TemporaryDirectory(prefix="gyre-warm-") as tmp:
            result = {"model": args.model, **warm_start(args.model, args.warm_start, args.keep or Path(tmp))}
        _emit(result, args.out, compact=True)
        return
    if args.resume and args.keep is None:
        raise SystemExit("--resume continues the runs --keep holds: give --keep DIR")
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    if args.families:
        overrides["rollout.task_ids"] = interleaved(args.families, TrainConfig.load(CONFIG).rollout.tasks)
    with tempfile.TemporaryDirectory(prefix="gyre-warm-") as tmp:
        root = args.keep or Path(tmp)
        result = {"model": args.model, "steps": args.steps, "overrides": overrides,
                  "per_seed": {s: run_seed(args.model, s, args.steps, args.every, root, samples=args.samples,
                                           shuffle_rewards=args.shuffle_rewards, overrides=overrides,
                                           resume=args.resume)
                               for s in args.seeds}}
    _emit(result, args.out, compact=args.json)


def _emit(result: dict[str, Any], out: Path | None, *, compact: bool) -> None:
    """Print the result, and write it to ``--out`` too when given (every mode)."""
    text = json.dumps(result) if compact else json.dumps(result, indent=2)
    if out is not None:
        out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
