"""Hand-built executions and batch readers shared by the trajectory tests."""

from collections.abc import Iterable, Sequence

import numpy as np

from gyre.events import ModelCallFinished
from gyre.trajectory import CallTree, ExecutionCalls, ExecutionOutcome, Group, Member, MicroBatch
from gyre.trajectory.synth import SynthConfig

SMALL = SynthConfig(
    executions=32,
    group_size=16,
    seed=3,
    min_tokens=2_000,
    max_tokens=10_000,
    eval_failure_rate=0.15,
    timeout_rate=0.15,
    harness_error_rate=0.05,
)
"""The shared small run: hundreds of calls per execution like the real thing, ~6K tokens each, not ~400K."""


def call(
    call_id: str,
    *,
    parent: str | None = None,
    prefix: int = 0,
    delta: Sequence[int] = (),
    out: Sequence[int] = (),
    branch: str = "main",
    version: int = 0,
    execution: str = "e1",
    seq: int | None = None,
) -> ModelCallFinished:
    """A model call; output log-probs are ``-token / 1000`` so that tests can tell tokens apart by them."""
    return ModelCallFinished(
        execution_id=execution,
        call_id=call_id,
        cell_id="cell-0",
        parent_call_id=parent,
        branch=branch,
        prefix_len=prefix,
        prompt_delta_ids=list(delta),
        output_ids=list(out),
        output_logprobs=[-t / 1000 for t in out],
        policy_version=version,
        seq=seq,
    )


def calls(*events: ModelCallFinished) -> ExecutionCalls:
    return ExecutionCalls.from_events(list(events))


def outcome(
    execution_id: str,
    group: str | None = "g1",
    reward: float | None = 0.5,
    *,
    status: str = "completed",
    error: str | None = None,
    partial: bool = False,
    n_calls: int = 1,
) -> ExecutionOutcome:
    return ExecutionOutcome(
        execution_id=execution_id,
        group_id=group,
        task_id="t1",
        status=status,  # type: ignore[arg-type]
        reward=reward,
        partial=partial,
        eval_error=error,
        calls=n_calls,
    )


def group(members: Iterable[tuple[ExecutionOutcome, ExecutionCalls | None]], group_id: str = "g1") -> Group:
    return Group(group_id, tuple(Member(o, c) for o, c in members))


def rows(batches: Iterable[MicroBatch]) -> list[dict]:
    """Every row of every micro-batch as a dict of Python values."""
    return [row for batch in batches for row in batch.batch.to_pylist()]


def trained(row: dict) -> dict[int, float]:
    """Trained token id -> weight for one row (tests use distinct ids for distinct tokens)."""
    return {t: w for t, m, w in zip(row["input_ids"], row["loss_mask"], row["token_weights"], strict=True) if m}


def ancestors_mask(parents: Sequence[int]) -> np.ndarray:
    """Dense tree mask from parent links: ``mask[i, j]`` iff ``j`` is ``i`` or an ancestor of ``i``."""
    n = len(parents)
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def interval_mask(subtree_end: Sequence[int]) -> np.ndarray:
    """Dense tree mask from subtree ends: ``mask[i, j]`` iff ``j <= i < subtree_end[j]``."""
    n = len(subtree_end)
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    return (j <= i) & (i < np.asarray(subtree_end)[None, :])


def branchy() -> CallTree:
    """A main agent with a failed retry, a compaction, a sub-agent with its own summary."""
    return CallTree.build(
        calls(
            call("m1", delta=[1, 2], out=[3, 4]),  # 0
            call("fail", parent="m1", prefix=4, delta=[5], out=[6]),  # 1 end: main
            call("m2", parent="fail", prefix=5, out=[7, 8]),  # 2 retry of "fail"
            call("sum", parent="m2", prefix=7, delta=[9], out=[10, 11, 12], branch="main-summary"),  # 3 end
            call("s1", delta=[20], out=[21, 22, 23, 24], branch="sub-agent"),  # 4
            call("ssum", parent="s1", prefix=5, delta=[25], out=[26], branch="sub-agent-summary"),  # 5 end
            call("s2", delta=[30], out=[31, 32, 33, 34, 35, 36], branch="sub-agent"),  # 6 end
            call("m3", delta=[1, 10, 11, 12], out=[13]),  # 7
            call("m4", parent="m3", prefix=5, delta=[14], out=[15, 16]),  # 8 end: main
        )
    )
