"""Plain-HF reference computations and small waits shared by the engine tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tests.conftest import HANG_S


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """`[len(ids), vocab]` float32 logits of one plain forward pass."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model: torch.nn.Module, ids: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """A plain, cache-free greedy loop: argmax of a full forward pass per token."""
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(hf_logits(model, ids + out)[-1].argmax())
        out.append(nxt)
        if nxt in eos:
            break
    return out


def wait_for(predicate: Callable[[], bool], timeout_s: float = HANG_S) -> None:
    """Poll until `predicate` holds. Only for states that stay once reached (a request queued, a counter
    reached): the deadline bounds a hang and never decides an outcome."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)
