"""Does a tiny model copy what it read? Two checks for the learning run (#29), JSON out.

    python benchmarks/copy_check.py synthetic --base runs/learn/sft/base --lr 1e-3 3e-3 1e-2 --steps 300
    python benchmarks/copy_check.py drills --base runs/learn/sft/base \
        --checkpoint runs/learn/sft/checkpoints/step-000700

``synthetic``: a fresh model of the base checkpoint's shape trained on nothing but copying (8 random letters,
0-20 random letters of filler, a separator, the 8 letters again; loss on the copy), once per learning rate:
the loss after ``--steps`` says whether that rate forms a copying circuit at all (ln 26 = 3.26 is guessing).
``drills``: the loss per token, on held-back copy drills (`gyre.sft.families.drill_tasks`), of a `gyre sft`
checkpoint — the letters it writes into ``answer.txt`` apart from the rest of its turns.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from gyre.model.tiny import load_tiny
from gyre.sft.data import render
from gyre.sft.expert import Expert
from gyre.sft.families import LETTERS, drill_tasks
from gyre.sft.run import IGNORE


def synthetic(base: Path, lr: float, steps: int, seed: int = 0, batch: int = 64, length: int = 8) -> dict[str, Any]:
    """Train a fresh model of ``base``'s shape to copy; its loss every 25 steps."""
    torch.manual_seed(seed)
    model, tokenizer = load_tiny(base)
    letters = [tokenizer.convert_tokens_to_ids(c) for c in LETTERS]
    separator = tokenizer.convert_tokens_to_ids("|")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    curve = []
    for step in range(steps):
        rows = []
        for _ in range(batch):
            word = [rng.choice(letters) for _ in range(length)]
            filler = [rng.choice(letters) for _ in range(rng.randint(0, 20))]
            rows.append((word + filler + [separator] + word, len(word) + len(filler) + 1))
        width = max(len(r) for r, _ in rows)
        ids = torch.zeros(batch, width, dtype=torch.long)
        labels = torch.full((batch, width), IGNORE)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, (row, prompt) in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            labels[i, prompt:len(row)] = torch.tensor(row[prompt:])
            mask[i, :len(row)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 25 == 0 or step == steps - 1:
            curve.append([step, round(loss.item(), 3)])
    return {"lr": lr, "steps": steps, "final_loss": curve[-1][1], "curve": curve}


def drills(base: Path, checkpoint: Path, count: int = 40, seed: int = 99) -> dict[str, Any]:
    """Mean loss of the written letters and of the other assistant tokens, over ``count`` drills."""
    with tempfile.TemporaryDirectory(prefix="gyre-copy-check-") as tmp:
        model_dir = Path(tmp) / "model"
        shutil.copytree(base, model_dir)
        shutil.copy(checkpoint / "model.safetensors", model_dir / "model.safetensors")
        model, tokenizer = load_tiny(model_dir)
    model.eval()
    expert = Expert(seed=0)
    losses: dict[str, list[float]] = {"written_letters": [], "other_assistant_tokens": []}
    by_family: dict[str, list[float]] = {}
    for task in drill_tasks(count, seed):
        example = render(expert.drill(task), tokenizer)
        ids = torch.tensor([example.input_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0]
        token_loss = -torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        pieces = [tokenizer.decode([i]) for i in example.input_ids]
        start = "".join(pieces).index('"content": "') + len('"content": "')
        written, at = set(), 0
        for k, piece in enumerate(pieces):
            if start <= at < start + len(task.solution):
                written.add(k)
            at += len(piece)
        for k in range(1, len(pieces)):
            if example.assistant[k]:
                value = token_loss[k - 1].item()
                losses["written_letters" if k in written else "other_assistant_tokens"].append(value)
                if k in written:
                    by_family.setdefault(task.family, []).append(value)
    return {"checkpoint": str(checkpoint), **{k: round(statistics.mean(v), 3) for k, v in losses.items()},
            "written_letters_by_family": {f: round(statistics.mean(v), 3) for f, v in sorted(by_family.items())},
            "guessing": 3.258}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="check", required=True)
    s = sub.add_parser("synthetic")
    s.add_argument("--base", type=Path, required=True, help="a gyre sft run's base checkpoint (RUN_DIR/base)")
    s.add_argument("--lr", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    s.add_argument("--steps", type=int, default=300)
    d = sub.add_parser("drills")
    d.add_argument("--base", type=Path, required=True)
    d.add_argument("--checkpoint", type=Path, required=True, help="RUN_DIR/checkpoints/step-N")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.check == "synthetic":
        print(json.dumps({"synthetic": [synthetic(args.base, lr, args.steps) for lr in args.lr]}))
    else:
        print(json.dumps(drills(args.base, args.checkpoint)))


if __name__ == "__main__":
    main()
