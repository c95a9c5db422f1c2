"""Context shared across the rows of a micro-batch: one tree for a group's executions, the prompt forwarded once.

The rollouts of a GSPO group start from the same task prompt (for Claude Code ~49K tokens). Packed rows are
one tree per execution, so each row would forward that prompt again. ``share_context`` merges the rows
into one forest, token by token from the roots: two tokens become one node when both are **context**
(``mergeable``: not trained, no behaviour log-prob), have the same id and position, and their parents are
already one node. Their hidden states are then equal (same token, same position, same ancestors), so the
forward computes them once and every descendant still sees exactly its own path.

Policy tokens are never merged, even when two executions sampled the same ones: each execution keeps its
own tokens, its own GSPO ratios and weights. A context token under a policy token has a parent no other
row shares, so sharing stops at the first sampled token of each path.

The merged forest is laid out depth first (children in order of first appearance), so ``subtree_end``
keeps its meaning: token ``i`` sees ``j`` iff ``j <= i < subtree_end[j]``.

``leading_context`` and ``shared_length`` give the trajectory processor the size of a bin before any
token is copied: a row's first run of context tokens (its first call's prompt) counted once per bin. The
merge can only share more than that, so the bin's bound holds for what the trainer forwards.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class SharedForest:
    """The merged forest: each original token's node, and per node its source token, parent and subtree end."""

    node: np.ndarray
    """int64 ``[N]``: the node (index in the merged, depth-first order) of each original token."""
    source: np.ndarray
    """int64 ``[M]``: the first original token of each node (where its id and position come from)."""
    parent: np.ndarray
    """int64 ``[M]``: parent node, -1 at roots."""
    subtree_end: np.ndarray
    """int64 ``[M]``: one past the node's subtree."""

    @property
    def tokens(self) -> int:
        return len(self.source)


def share_context(
    parent: np.ndarray, input_ids: np.ndarray, position_ids: np.ndarray, mergeable: np.ndarray
) -> SharedForest | None:
    """Merge identical context paths of a forest whose tokens are ordered parents first (global indices);
    ``None`` when no two tokens merge (the forest stays as it is)."""
    n = len(parent)
    parent = np.asarray(parent, dtype=np.int64)
    canon = np.arange(n, dtype=np.int64)
    seen: dict[tuple[int, int, int], int] = {}
    ids, positions = input_ids.tolist(), position_ids.tolist()
    parents = parent.tolist()
    canon_list = canon.tolist()
    for t in np.flatnonzero(mergeable).tolist():
        p = parents[t]
        key = (canon_list[p] if p >= 0 else -1, ids[t], positions[t])
        first = seen.setdefault(key, t)
        if first != t:
            canon_list[t] = first
    canon = np.asarray(canon_list, dtype=np.int64)
    reps = np.flatnonzero(canon == np.arange(n))
    if len(reps) == n:
        return None
    dense = np.full(n, -1, dtype=np.int64)
    dense[reps] = np.arange(len(reps))
    rep_parent = np.where(parent[reps] >= 0, dense[canon[np.maximum(parent[reps], 0)]], -1)
    order, new_parent, ends = _depth_first(rep_parent)
    position = np.empty(len(reps), dtype=np.int64)
    position[order] = np.arange(len(reps))
    return SharedForest(
        node=position[dense[canon]], source=reps[order], parent=new_parent, subtree_end=ends
    )


def _depth_first(parent: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Preorder of a forest given parents-first (children keep their order), its parents and subtree ends."""
    m = len(parent)
    parents = parent.tolist()
    sizes = [1] * m
    for t in range(m - 1, -1, -1):
        p = parents[t]
        if p >= 0:
            sizes[p] += sizes[t]
    start = [0] * m  # preorder position of each node
    next_free = [0] * m  # next free position inside each node's subtree (for its next child)
    cursor = 0
    for t in range(m):
        p = parents[t]
        if p < 0:
            start[t] = cursor
            cursor += sizes[t]
        else:
            start[t] = next_free[p]
            next_free[p] += sizes[t]
        next_free[t] = start[t] + 1
    position = np.asarray(start, dtype=np.int64)
    order = np.empty(m, dtype=np.int64)
    order[position] = np.arange(m)
    new_parent = np.where(parent[order] >= 0, position[np.maximum(parent[order], 0)], -1)
    ends = np.arange(m, dtype=np.int64) + np.asarray(sizes, dtype=np.int64)[order]
    return order, new_parent, ends


def lcp(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def shared_length(lengths: list[int], prefixes: list[np.ndarray], members: list[int], candidate: int) -> int:
    """Tokens ``candidate`` adds to a bin of ``members``: its length less its longest common leading context."""
    saved = max((lcp(prefixes[candidate], prefixes[m]) for m in members), default=0)
    return lengths[candidate] - saved
