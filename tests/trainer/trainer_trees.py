"""Random execution trees and the micro-batches the trajectory processor builds from them (test data)."""

import numpy as np

from gyre.events import ModelCallFinished
from gyre.model.tokenizer import VOCAB_SIZE
from gyre.trainer import GSPOConfig
from gyre.trajectory import BatchBuilder, ExecutionCalls, ExecutionOutcome, Group, Member, MicroBatch, TrajectoryConfig

BRANCHES = ("main", "main-summary", "sub-agent", "sub-agent-summary")
OPEN_CLIP = GSPOConfig(eps_low=0.99, eps_high=100.0, tis_cap=None)
"""A clip range nothing reaches: every unit contributes gradient, so equivalence tests compare real signal."""


def random_execution(
    rng: np.random.Generator, execution_id: str, calls: int = 8, prompt: np.ndarray | None = None
) -> ExecutionCalls:
    """A random call tree: extensions, mid-prefix branches (retries, siblings) and new roots.

    Roots start with context (a call's first token needs a predecessor to be trained); behaviour log-probs
    lie near the tiny model's own (about -log 265), so GSPO ratios are near 1 but not equal to it. With a
    ``prompt``, every root starts with it (the group's task prompt).
    """
    events: list[ModelCallFinished] = []
    full_len: list[int] = []
    for k in range(calls):
        if k == 0 or rng.random() < 0.15:
            parent, prefix = None, 0
        else:
            parent = int(rng.integers(0, k))
            prefix = full_len[parent] if rng.random() < 0.6 else int(rng.integers(1, full_len[parent] + 1))
        delta = rng.integers(0, VOCAB_SIZE, int(rng.integers(1 if parent is None else 0, 5)))
        if parent is None and prompt is not None:
            delta = np.concatenate([prompt, delta])
        output = rng.integers(0, VOCAB_SIZE, int(rng.integers(1, 7)))
        events.append(
            ModelCallFinished(
                execution_id=execution_id,
                call_id=f"{execution_id}/c{k}",
                cell_id="cell-0",
                parent_call_id=None if parent is None else f"{execution_id}/c{parent}",
                branch=BRANCHES[int(rng.integers(0, 4))],
                prefix_len=prefix,
                prompt_delta_ids=delta.tolist(),
                output_ids=output.tolist(),
                output_logprobs=rng.uniform(-6.5, -4.5, len(output)).tolist(),
                policy_version=0,
            )
        )
        full_len.append(prefix + len(delta) + len(output))
    return ExecutionCalls.from_events(events)


def random_group(
    seed: int, executions: int = 3, calls: int = 8, group_id: str = "g0", prompt_tokens: int = 0
) -> Group:
    """A group of random executions; ``prompt_tokens > 0`` gives them a shared task prompt of that length."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB_SIZE, prompt_tokens) if prompt_tokens else None
    members = []
    for e in range(executions):
        execution_id = f"{group_id}-e{e}"
        outcome = ExecutionOutcome(
            execution_id=execution_id, group_id=group_id, task_id="t0", status="completed",
            reward=float(rng.random()), calls=calls,
        )
        members.append(Member(outcome, random_execution(rng, execution_id, calls, prompt)))
    return Group(group_id, tuple(members))


def micro_batches(
    groups: list[Group], form: str, cap: int | None = 5, token_budget: int = 1 << 20
) -> list[MicroBatch]:
    builder = BatchBuilder(TrajectoryConfig(cap=cap, form=form, token_budget=token_budget))  # type: ignore[arg-type]
    return list(builder.batches(groups))
