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
import tempfile
from pathlib import Path
from typing import Any

import torch

from gyre.model.tiny import load_tiny
from gyre.sft.copying import written_letter_loss
from gyre.sft.families import LETTERS
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


def drills(base: Path, checkpoint: Path, count: int = 40) -> dict[str, Any]:
    """`gyre.sft.copying.written_letter_loss` of a `gyre sft` checkpoint (the base's tokenizer and config)."""
    with tempfile.TemporaryDirectory(prefix="gyre-copy-check-") as tmp:
        model_dir = Path(tmp) / "model"
        shutil.copytree(base, model_dir)
        shutil.copy(checkpoint / "model.safetensors", model_dir / "model.safetensors")
        model, tokenizer = load_tiny(model_dir)
    return {"checkpoint": str(checkpoint), **written_letter_loss(model, tokenizer, count)}


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
