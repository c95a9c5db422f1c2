"""Shared context across rows (``gyre.trajectory.share``): every token keeps its path, policy tokens stay apart."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gyre.trajectory.share import share_context


@st.composite
def forests(draw):
    """Rows of random trees in depth-first order; small alphabets so that paths coincide often."""
    parent, ids, positions, mergeable = [], [], [], []
    for _ in range(draw(st.integers(1, 5))):
        stack: list[int] = []
        for _ in range(draw(st.integers(1, 25))):
            keep = draw(st.integers(0, len(stack)))  # 0: a new root of this row
            del stack[keep:]
            parent.append(stack[-1] if stack else -1)
            positions.append(positions[stack[-1]] + 1 if stack else 0)
            ids.append(draw(st.integers(0, 2)))
            mergeable.append(draw(st.booleans()) or draw(st.booleans()))
            stack.append(len(parent) - 1)
    return (np.array(parent), np.array(ids), np.array(positions), np.array(mergeable))


def path(parent, ids, positions, t):
    out = []
    while t >= 0:
        out.append((int(ids[t]), int(positions[t])))
        t = int(parent[t])
    return out[::-1]


@settings(max_examples=150, deadline=None)
@given(forests())
def test_sharing_keeps_every_path_and_never_merges_policy_tokens(forest):
    parent, ids, positions, mergeable = forest
    shared = share_context(parent, ids, positions, mergeable)
    if shared is None:  # nothing merged: no two context tokens with one parent, id and position
        keys = [(int(parent[t]), int(ids[t]), int(positions[t])) for t in np.flatnonzero(mergeable)]
        assert len(keys) == len(set(keys))
        return
    assert shared.tokens < len(parent)
    new_ids, new_pos = ids[shared.source], positions[shared.source]
    m = shared.tokens
    # a depth-first forest: parents first, subtrees contiguous and nested, roots tiling [0, m)
    ar = np.arange(m)
    assert (shared.parent < ar).all()
    assert ((shared.subtree_end > ar) & (shared.subtree_end <= m)).all()
    child = np.flatnonzero(shared.parent >= 0)
    assert (shared.subtree_end[child] <= shared.subtree_end[shared.parent[child]]).all()
    roots = np.flatnonzero(shared.parent < 0)
    assert roots[0] == 0 and (shared.subtree_end[roots][:-1] == roots[1:]).all() and shared.subtree_end[roots[-1]] == m
    # subtree_end is the tree: j is an ancestor of i iff j <= i < subtree_end[j]
    for i in range(m):
        ancestors = set()
        t = i
        while t >= 0:
            ancestors.add(t)
            t = int(shared.parent[t])
        assert ancestors == {j for j in range(i + 1) if i < shared.subtree_end[j]}
    # every token keeps its path; a policy token is its own node; context merges whenever paths agree
    for t in range(len(parent)):
        assert path(shared.parent, new_ids, new_pos, int(shared.node[t])) == path(parent, ids, positions, t)
    policy = np.flatnonzero(~mergeable)
    assert len(set(shared.node[policy].tolist())) == len(policy)
    assert not set(shared.node[policy].tolist()) & set(shared.node[mergeable].tolist())
    keys = {}
    for t in np.flatnonzero(mergeable):
        p = int(parent[t])
        key = (int(shared.node[p]) if p >= 0 else -1, int(ids[t]), int(positions[t]))
        assert keys.setdefault(key, int(shared.node[t])) == int(shared.node[t])


def test_two_rows_with_one_prompt_become_one_tree():
    """Rows ``p q a`` and ``p q b`` (``a``, ``b`` sampled): the prompt once, both sampled tokens under it."""
    parent = np.array([-1, 0, 1, -1, 3, 4])
    ids = np.array([7, 8, 1, 7, 8, 1])
    shared = share_context(parent, ids, np.array([0, 1, 2, 0, 1, 2]), np.array([1, 1, 0, 1, 1, 0], dtype=bool))
    assert shared is not None and shared.tokens == 4
    assert shared.node.tolist() == [0, 1, 2, 0, 1, 3]  # identical sampled tokens stay two nodes
    assert shared.parent.tolist() == [-1, 0, 1, 1] and shared.subtree_end.tolist() == [4, 4, 3, 4]
    assert share_context(parent, np.arange(6), np.zeros(6, dtype=int), np.ones(6, dtype=bool)) is None
