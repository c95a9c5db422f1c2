"""The prefix tree of one execution, kept at call granularity.

Every recorded token is a node of a token trie: inside a segment each token follows the previous one,
and a call's first token follows the last token it shares with its parent (position ``prefix_len - 1`` of
the parent's full sequence). That shared token may lie in an ancestor further up when ``prefix_len`` is
shorter than the parent's own prefix (a retry of an earlier prompt), or in the middle of a segment.
We record it as ``owner`` (the call whose segment holds it) and ``attach`` (its offset there), which
turns the calls into a forest whose edges say how much of the owner's segment a child's path uses.

A trajectory is a root-to-leaf path of the trie. Its leaf is the last token of an *end* call: a call whose
last token no other call continues. Every token lies on at least one trajectory, so nothing recorded is
unreachable. A trajectory's tokens are ``seg(root)[:u] ... seg(end)``, spans of the shared buffer.

Invariants (checked in ``build``): ``prefix_len > 0`` needs a parent; ``prefix_len`` never exceeds the
parent's full length; parent links are acyclic.
"""

from dataclasses import dataclass

import numpy as np

from gyre.trajectory.calls import ExecutionCalls
from gyre.trajectory.errors import TrajectoryError


@dataclass(frozen=True, eq=False)
class CallTree:
    """Owner forest, depth-first order and trajectory ends of one execution's calls."""

    calls: ExecutionCalls
    owner: np.ndarray
    """int32: the call whose segment holds the last token this call shares (-1: the call is a root)."""
    attach: np.ndarray
    """int64: offset of that token inside the owner's segment (-1 for roots)."""
    preorder: np.ndarray
    """int32 call indices, depth first; a call's children follow it by attach offset descending, then seq,
    so that the subtree of every token is one contiguous range once the segments are laid out in order."""
    position: np.ndarray
    """int32: each call's index in ``preorder``."""
    stop: np.ndarray
    """int32: the ``preorder`` index just after each call's subtree."""
    ends: np.ndarray
    """int32 calls whose last token ends a trajectory, in seq order."""

    @property
    def full_len(self) -> np.ndarray:
        return self.calls.prefix_len + self.calls.seg_len

    @classmethod
    def build(cls, calls: ExecutionCalls) -> "CallTree":
        n = calls.n
        parent, prefix_len, seg_len = calls.parent, calls.prefix_len, calls.seg_len
        _check_links(calls)
        owner = parent.astype(np.int32, copy=True)
        owner[prefix_len == 0] = -1
        # Walk up while the shared prefix ends before the candidate's own segment starts. Usually zero steps.
        for _ in range(n + 1):
            has = owner >= 0
            deeper = np.zeros(n, dtype=bool)
            deeper[has] = prefix_len[has] <= prefix_len[owner[has]]
            if not deeper.any():
                break
            owner[deeper] = parent[owner[deeper]]
        attach = np.where(owner >= 0, prefix_len - 1 - prefix_len[np.maximum(owner, 0)], -1).astype(np.int64)
        extended = np.zeros(n, dtype=bool)
        # Only a child with tokens continues its owner (an empty call has no token for a path to end on).
        child = np.flatnonzero((owner >= 0) & (seg_len > 0) & (attach == seg_len[np.maximum(owner, 0)] - 1))
        extended[owner[child]] = True
        is_end = (seg_len > 0) & ~extended
        ends = np.flatnonzero(is_end).astype(np.int32)
        ends = ends[np.argsort(calls.seq[ends], kind="stable")]
        preorder, stop_by_position = _depth_first(owner, attach, calls.seq)
        position = np.empty(n, dtype=np.int32)
        position[preorder] = np.arange(n, dtype=np.int32)
        stop = stop_by_position[position]
        return cls(calls=calls, owner=owner, attach=attach, preorder=preorder, position=position, stop=stop, ends=ends)

    def used(self, ends: np.ndarray) -> np.ndarray:
        """``[len(ends), n]`` int64: how many tokens of each call's segment lie on each end's trajectory."""
        calls = self.calls
        ends = np.asarray(ends, dtype=np.int64)
        used = np.zeros((len(ends), calls.n), dtype=np.int64)
        if not len(ends):
            return used
        pos_end = self.position[ends][:, None]
        on_path = (self.position[None, :] <= pos_end) & (pos_end < self.stop[None, :])
        rows, cols = np.nonzero(on_path & (self.owner >= 0)[None, :])
        used[rows, self.owner[cols]] = self.attach[cols] + 1
        used[np.arange(len(ends)), ends] = calls.seg_len[ends]
        return used

    def spans(self, call: int) -> list[tuple[int, int]]:
        """The full sequence of any call as ``(call, length)`` spans, root first: each span is the first
        ``length`` tokens of that call's segment. Nothing is copied; ``sequence`` joins them."""
        out: list[tuple[int, int]] = []
        node, length = int(call), int(self.calls.seg_len[call])
        while node >= 0:
            out.append((node, length))
            node, length = int(self.owner[node]), int(self.attach[node]) + 1
        return out[::-1]

    def sequence(self, call: int) -> np.ndarray:
        """Token ids of a call's full sequence (prompt + output), built from its spans."""
        starts = self.calls.seg_start
        parts = [self.calls.tokens[starts[c] : starts[c] + n] for c, n in self.spans(call)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def path(self, end: int) -> np.ndarray:
        """Calls of ``end``'s trajectory, root first (their ``prefix_len`` strictly increases)."""
        return np.array([c for c, _ in self.spans(end)], dtype=np.int32)


def _check_links(calls: ExecutionCalls) -> None:
    parent, prefix_len = calls.parent, calls.prefix_len
    full_len = prefix_len + calls.seg_len
    orphan = np.flatnonzero((parent < 0) & (prefix_len > 0))
    if len(orphan):
        i = int(orphan[0])
        raise TrajectoryError(
            f"call {calls.call_ids[i]!r} of execution {calls.execution_id!r} has prefix_len "
            f"{prefix_len[i]} but no parent_call_id"
        )
    has = parent >= 0
    too_long = np.flatnonzero(has & (prefix_len > full_len[np.maximum(parent, 0)]))
    if len(too_long):
        i = int(too_long[0])
        p = int(parent[i])
        raise TrajectoryError(
            f"call {calls.call_ids[i]!r} of execution {calls.execution_id!r} has prefix_len {prefix_len[i]}, "
            f"longer than the full sequence of its parent {calls.call_ids[p]!r} ({full_len[p]} tokens)"
        )
    # Acyclic parent links: walk each call up until a call already known to reach a root.
    state = np.zeros(len(parent), dtype=np.int8)  # 0 unknown, 1 on the current walk, 2 reaches a root
    for start in range(len(parent)):
        walk = []
        node = start
        while node >= 0 and state[node] == 0:
            state[node] = 1
            walk.append(node)
            node = int(parent[node])
        if node >= 0 and state[node] == 1:
            raise TrajectoryError(
                f"calls of execution {calls.execution_id!r} form a parent cycle through {calls.call_ids[node]!r}"
            )
        state[walk] = 2


def _depth_first(owner: np.ndarray, attach: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Preorder of the owner forest and, per preorder position, the position after that subtree."""
    n = len(owner)
    order = np.lexsort((seq, -attach, owner))  # roots (owner -1) first, then children grouped by owner
    owners = owner[order]
    first_child = np.searchsorted(owners, np.arange(n), side="left")
    last_child = np.searchsorted(owners, np.arange(n), side="right")
    roots = order[: int(np.searchsorted(owners, 0, side="left"))]
    preorder = np.empty(n, dtype=np.int32)
    stop = np.empty(n, dtype=np.int32)
    count = 0
    stack: list[tuple[int, bool]] = [(int(r), False) for r in roots[::-1]]
    slots = np.empty(n, dtype=np.int32)  # preorder position of each call, to close its subtree
    while stack:
        node, closing = stack.pop()
        if closing:
            stop[slots[node]] = count
            continue
        slots[node] = count
        preorder[count] = node
        count += 1
        stack.append((node, True))
        children = order[first_child[node] : last_child[node]]
        stack.extend((int(c), False) for c in children[::-1])
    return preorder, stop
