"""Token layouts of one batch row: runs of segment prefixes, and how the row's tokens relate.

A row — a packed execution tree or one expanded trajectory — is a sequence of *runs*: the first
``count`` tokens of some call's segment. Everything per token (ids, log-probs, positions, parents, subtree
ends, owners, weights) is constant or an arithmetic progression along a run, so a row is written with a
few slice operations per run, straight into the micro-batch buffers: one pass per column, no per-token
index arrays.
"""

from dataclasses import dataclass

import numpy as np

from gyre.trajectory.selection import Selection


@dataclass(frozen=True, eq=False)
class Layout:
    """The runs of one row and the ranges of tokens each kept trajectory trains."""

    selection: Selection
    calls: np.ndarray
    """int64 call of each run; the run is that call's segment prefix of length ``counts``."""
    starts: np.ndarray
    """int64 index of each run's first token within the row."""
    counts: np.ndarray
    owned: np.ndarray
    """``[m, 3]`` int64 rows ``(start, stop, rank)``: tokens ``[start, stop)`` of the row are trained by
    kept trajectory ``rank``; ranges are disjoint; tokens outside them are not trained."""
    first_parent: np.ndarray | None = None
    """Packed rows: parent index of each run's first token (-1 at roots)."""
    subtree: np.ndarray | None = None
    """Packed rows: ``[m, 3]`` rows ``(start, stop, end)``, applied in order: tokens ``[start, stop)`` have
    subtree end ``end``. Later rows overwrite earlier ones."""
    trajectory_ends: np.ndarray | None = None
    """Packed rows: index of the last token of each kept trajectory, by rank."""

    @property
    def length(self) -> int:
        return int(self.counts.sum())

    def write(self, out: dict[str, np.ndarray], token_weight: float, advantage: float) -> None:
        """Fill this row's slice of every token column (``out`` holds views of exactly this row)."""
        calls = self.selection.tree.calls
        total = self.length
        sources = [(int(s), int(s + c)) for s, c in zip(calls.seg_start[self.calls], self.counts, strict=True)]
        np.concatenate([calls.tokens[a:b] for a, b in sources] or [np.zeros(0, np.int32)], out=out["input_ids"])
        np.concatenate(self._logprob_parts() or [np.zeros(0, np.float32)], out=out["behaviour_logprobs"])
        ramp = np.arange(total, dtype=np.int32)
        positions, versions = out["position_ids"], out["policy_versions"]
        for start, count, first, version in zip(
            self.starts.tolist(),
            self.counts.tolist(),
            calls.prefix_len[self.calls].tolist(),
            calls.version[self.calls].tolist(),
            strict=True,
        ):
            positions[start : start + count] = ramp[:count]
            positions[start : start + count] += first
            versions[start : start + count] = version
        mask, weights = out["loss_mask"], out["token_weights"]
        mask[:] = 0
        weights[:] = 0
        out["advantages"][:] = advantage
        owner = out.get("trajectory_ids")
        if owner is not None:
            owner[:] = -1
        for start, stop, rank in self.owned.tolist():
            mask[start:stop] = 1
            weights[start:stop] = token_weight
            if owner is not None:
                owner[start:stop] = rank
        if self.first_parent is not None and self.subtree is not None:
            parents = out["parent_ids"]
            np.subtract(ramp, 1, out=parents)
            parents[self.starts] = self.first_parent
            ends = out["subtree_end"]
            for start, stop, end in self.subtree.tolist():
                ends[start:stop] = end

    def _logprob_parts(self) -> list[np.ndarray]:
        """Per run: zeros for its context tokens, then the behaviour log-probs of its policy tokens."""
        calls = self.selection.tree.calls
        context = np.minimum(self.counts, calls.delta_len[self.calls])
        zeros = np.zeros(int(context.max(initial=0)), dtype=np.float32)
        parts = []
        for ctx, count, first in zip(
            context.tolist(), self.counts.tolist(), calls.out_start[self.calls].tolist(), strict=True
        ):
            parts.append(zeros[:ctx])
            parts.append(calls.logprobs[first : first + count - ctx])
        return parts


def packed(selection: Selection) -> Layout:
    """The kept trajectories as one tree: each kept segment prefix once, depth first (see ``CallTree``).

    Subtree ends: a run's tokens reach at least the end of the run; a token at or before a child's attach
    point also reaches the end of that child's subtree. Children come after their parent's run sorted by
    attach offset descending, so writing the children's ranges in layout order leaves each token the
    largest, i.e. correct, end.
    """
    tree, calls = selection.tree, selection.tree.calls
    cover = selection.cover
    kept = tree.preorder[cover[tree.preorder] > 0].astype(np.int64)
    counts = cover[kept]
    starts = np.zeros(len(kept), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    total = int(counts.sum())
    start_of = np.full(calls.n, -1, dtype=np.int64)
    start_of[kept] = starts

    owner_call = tree.owner[kept]
    linked = owner_call >= 0
    attach_at = np.where(linked, start_of[np.maximum(owner_call, 0)] + tree.attach[kept], -1)
    assert (start_of[owner_call[linked]] >= 0).all(), "a kept call's owner must be kept"

    next_run = np.searchsorted(tree.position[kept], tree.stop[kept], side="left")
    call_end = np.append(starts, total)[next_run]
    own = np.stack([starts, starts + counts, starts + counts], axis=1)
    children = np.flatnonzero(linked)
    reach = np.stack([start_of[owner_call[children]], attach_at[children] + 1, call_end[children]], axis=1)
    subtree = np.concatenate([own, reach]) if len(reach) else own

    rank, cols = np.nonzero(selection.hi > selection.lo)
    owned = np.stack(
        [start_of[cols] + selection.lo[rank, cols], start_of[cols] + selection.hi[rank, cols], rank], axis=1
    )
    ends = selection.kept
    return Layout(
        selection=selection,
        calls=kept,
        starts=starts,
        counts=counts,
        owned=owned.reshape(-1, 3),
        first_parent=attach_at.astype(np.int32),
        subtree=subtree.reshape(-1, 3),
        trajectory_ends=(start_of[ends] + calls.seg_len[ends] - 1).astype(np.int32),
    )


def leading_context(selection: Selection) -> np.ndarray:
    """The context tokens a packed row starts with: its first run's prompt (for a rollout, the task prompt).

    The first run of ``packed`` is the first kept call in depth-first order; its segment starts with the
    call's ``prompt_delta_ids`` (context), then its output (policy tokens)."""
    tree, calls = selection.tree, selection.tree.calls
    cover = selection.cover
    kept = tree.preorder[cover[tree.preorder] > 0]
    if not len(kept):
        return np.zeros(0, dtype=np.int32)
    first = int(kept[0])
    count = int(min(cover[first], calls.delta_len[first]))
    start = int(calls.seg_start[first])
    return calls.tokens[start : start + count]


def expanded(selection: Selection, rank: int) -> Layout:
    """Kept trajectory ``rank`` as a plain sequence, training only the tokens it owns."""
    calls = selection.tree.calls
    used = selection.used[rank]
    path = np.flatnonzero(used)
    path = path[np.argsort(calls.prefix_len[path], kind="stable")]
    counts = used[path]
    starts = np.zeros(len(path), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    lo, hi = selection.lo[rank, path], selection.hi[rank, path]
    keep = hi > lo
    owned = np.stack([starts[keep] + lo[keep], starts[keep] + hi[keep], np.full(int(keep.sum()), rank)], axis=1)
    return Layout(
        selection=selection, calls=path.astype(np.int64), starts=starts, counts=counts, owned=owned.reshape(-1, 3)
    )
