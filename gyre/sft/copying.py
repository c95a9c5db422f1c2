"""Does the model copy what it read? The loss of the letters it writes into the answer file on held-back copy
drills (random letter strings, so only reading the tool result predicts them; ln 26 = 3.26 nats is guessing).

One place for the measure a curriculum phase ends on (`[[phases]] until_written_loss`) and
`benchmarks/copy_check.py drills` reports.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

GUESSING = 3.258
"""ln 26: the written letters' loss of a model that does not read its input."""
HELD_BACK_SEED = 99
"""The seed of the held-back drills (training drills use the run's seed: random strings, so never the same)."""


def written_letter_loss(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, count: int = 40,
                        seed: int = HELD_BACK_SEED) -> dict[str, Any]:
    """Mean loss of the letters written into ``answer.txt`` and of the other assistant tokens over ``count``
    held-back drills, and the written letters' loss per family."""
    import torch

    from gyre.sft.data import render
    from gyre.sft.expert import Expert
    from gyre.sft.families import drill_tasks

    training = model.training
    model.eval()
    expert = Expert(seed=0)
    losses: dict[str, list[float]] = {"written_letters": [], "other_assistant_tokens": []}
    by_family: dict[str, list[float]] = {}
    try:
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
    finally:
        model.train(training)
    return {**{k: round(statistics.mean(v), 3) for k, v in losses.items()},
            "written_letters_by_family": {f: round(statistics.mean(v), 3) for f, v in sorted(by_family.items())},
            "guessing": GUESSING}
