"""Bounded sampling and ownership: which trajectories of an execution are kept, and who trains each token.

Ranking (a total order, applied greedily):

1. branch of the trajectory's end call: main > main-summary > sub-agent > sub-agent-summary;
2. more *new* policy tokens first — tokens that no trajectory ranked before it already trains;
3. earlier end call first (lower log ``seq``), which makes the order total and reproducible.

The first ``cap`` trajectories with at least one new policy token are kept. A trajectory whose policy
tokens are all trained already adds forward cost and no signal, so it is dropped as *redundant* rather
than taking a slot. Because the order is greedy, the kept set for cap ``k`` is a prefix of the kept set
for cap ``k + 1``.

"Trained once": each policy token on a kept trajectory is owned by the first kept trajectory (in rank
order) that contains it, and only the owner's loss counts it. Coverage of a segment is always a prefix
of it, so ownership is a range per (trajectory, call): ``[lo, hi)``.
"""

from dataclasses import dataclass

import numpy as np

from gyre.trajectory.tree import CallTree


@dataclass(frozen=True, eq=False)
class Selection:
    """Kept trajectories of one execution in rank order, with the ranges of tokens each one trains."""

    tree: CallTree
    kept: np.ndarray
    """int32 end calls of the kept trajectories, best first."""
    used: np.ndarray
    """``[K, n]``: tokens of each call's segment on each kept trajectory."""
    lo: np.ndarray
    """``[K, n]``: first segment offset of the policy tokens each kept trajectory owns in each call."""
    hi: np.ndarray
    """``[K, n]``: end of that range, which is ``used`` (``hi == lo``: owns nothing there)."""
    trained: np.ndarray
    """``[K]``: policy tokens each kept trajectory trains."""
    trajectories: int
    """All trajectories of the execution."""
    capped_ends: np.ndarray
    """End calls of trajectories with new policy tokens that the cap left out."""
    redundant_ends: np.ndarray
    """End calls of trajectories left out because every policy token on them is already trained."""
    tokens_expanded_all: int
    """Sum of the lengths of all trajectories: forward tokens of uncapped expansion."""

    @property
    def cover(self) -> np.ndarray:
        """Tokens of each call's segment in the packed tree (coverage is a prefix of each segment)."""
        if not len(self.kept):
            return np.zeros(self.tree.calls.n, dtype=np.int64)
        return self.used.max(axis=0)

    @property
    def capped(self) -> int:
        return len(self.capped_ends)

    @property
    def redundant(self) -> int:
        return len(self.redundant_ends)

    @property
    def policy_tokens_trained(self) -> int:
        return int(self.trained.sum())

    @property
    def tokens_expanded(self) -> int:
        return int(self.tree.full_len[self.kept].sum())

    @property
    def tokens_packed(self) -> int:
        return int(self.cover.sum())


def select(tree: CallTree, cap: int | None) -> Selection:
    """Rank the trajectories of ``tree`` and keep at most ``cap`` (``None``: all that add a token)."""
    calls = tree.calls
    ends = tree.ends
    used_all = tree.used(ends)
    rank = calls.branch[ends].astype(np.int64)
    seq = calls.seq[ends]
    covered = np.zeros(calls.n, dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    redundant: list[int] = []
    picks: list[int] = []
    rows_lo: list[np.ndarray] = []
    rows_hi: list[np.ndarray] = []
    trained: list[int] = []
    while alive.any():
        floor = np.maximum(covered, calls.delta_len)
        gain = np.zeros(len(ends), dtype=np.int64)
        live = np.flatnonzero(alive)
        gain[live] = np.clip(used_all[live] - floor, 0, None).sum(axis=1)
        spent = alive & (gain == 0)
        redundant.extend(np.flatnonzero(spent).tolist())
        alive &= ~spent
        if not alive.any() or (cap is not None and len(picks) >= cap):
            break
        live = np.flatnonzero(alive)
        best = int(live[np.lexsort((seq[live], -gain[live], rank[live]))[0]])
        picks.append(best)
        rows_lo.append(np.minimum(floor, used_all[best]))  # empty ranges collapse to [used, used)
        rows_hi.append(used_all[best])
        trained.append(int(gain[best]))
        covered = np.maximum(covered, used_all[best])
        alive[best] = False
    n = calls.n
    return Selection(
        tree=tree,
        kept=ends[picks].astype(np.int32),
        used=used_all[picks] if picks else np.zeros((0, n), dtype=np.int64),
        lo=np.array(rows_lo, dtype=np.int64).reshape(len(picks), n),
        hi=np.array(rows_hi, dtype=np.int64).reshape(len(picks), n),
        trained=np.array(trained, dtype=np.int64),
        trajectories=len(ends),
        capped_ends=ends[np.flatnonzero(alive)],
        redundant_ends=ends[np.sort(np.array(redundant, dtype=np.int64))],
        tokens_expanded_all=int(tree.full_len[ends].sum()),
    )
