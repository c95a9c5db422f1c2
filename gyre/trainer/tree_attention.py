"""Sparse tree attention: exact attention under the tree mask without ever building an ``L x L`` mask.

The tree mask (``gyre.trainer.batch``) lets query ``i`` see key ``j`` iff ``j <= i < subtree_end[j]``:
``j`` is ``i`` or one of its ancestors. Queries are cut into chunks of at most ``chunk`` consecutive tokens
(never across an attention block, and ending early where a sibling branch starts). For a chunk
``[c0, c1)`` every key any of its queries can see is either inside the chunk or an ancestor of ``c0`` (a key
``j < c0`` seen by ``i >= c0`` has ``c0`` in its subtree ``[j, subtree_end[j])``). So each chunk attends
over ``ancestors(c0) + [c0, c1)`` with a small boolean mask of ``chunk x keys`` computed on the fly from
``subtree_end``; nothing else is ever scored.

What is kept: ``subtree_end`` (one integer per token) and per chunk its ancestors as a few ranges (a run
of the tree is one range). When they are one range ending at ``c0`` (a plain sequence, a shared prompt) the
chunk attends over a slice of ``k``/``v``; otherwise it gathers its keys, transiently.
Backward memory is linear too: each chunk's attention runs under activation checkpointing, so autograd
keeps only views of ``q``, ``k``, ``v`` and recomputes the chunk's scores in backward; the gathered keys,
the chunk mask and the probabilities are transient, one chunk at a time.

Why not flex attention: torch 2.13's ``flex_attention`` refuses backward on CPU ("FlexAttention does not
support backward on CPU", eager and compiled alike), and its block mask is ``(L/128)^2`` entries, still
quadratic. See ``docs/trainer.md`` for the measurements.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gyre.trainer.errors import TrainerError

ATTN_IMPLEMENTATION = "gyre_tree"
"""The name the attention function is registered under in transformers' ``AttentionInterface``."""


@dataclass(frozen=True)
class Chunk:
    """Queries ``[q0, q1)`` of a pass and the keys they may see: the ``ancestors`` ranges, then ``[q0, q1)``."""

    q0: int
    q1: int
    ancestors: tuple[tuple[int, int], ...]
    """Ascending ``[a, z)`` ranges of the ancestors of ``q0`` (adjacent ranges joined)."""

    @property
    def contiguous(self) -> bool:
        """The keys are one range ending at the chunk's end: attend over a slice, gather nothing."""
        return not self.ancestors or (len(self.ancestors) == 1 and self.ancestors[0][1] == self.q0)

    @property
    def keys(self) -> int:
        return self.q1 - self.q0 + sum(z - a for a, z in self.ancestors)


@dataclass(frozen=True, eq=False)
class TreeMask:
    """The tree mask of one flat forward pass, as ``subtree_end`` plus the key set of each query chunk."""

    subtree_end: torch.Tensor
    """``[N]`` int64, local to the pass."""
    chunks: tuple[Chunk, ...]

    @classmethod
    def build(cls, parent: torch.Tensor, subtree_end: torch.Tensor, blocks: torch.Tensor, chunk: int) -> "TreeMask":
        """Chunks of at most ``chunk`` queries within each block (``blocks``: ``[K, 2]`` local ranges).

        The ancestors of a chunk's first token are found by walking ``parent`` one *run* at a time (a run is
        a stretch where each token's parent is the previous token), so they come as a few ranges."""
        if chunk < 1:
            raise TrainerError(f"tree attention chunk must be >= 1, got {chunk}")
        par = parent.numpy()
        n = len(par)
        ar = np.arange(n)
        starts = np.flatnonzero(par != ar - 1)
        run_start = np.maximum.accumulate(np.where(par != ar - 1, ar, 0)).tolist() if n else []
        parents = par.tolist()
        chunks: list[Chunk] = []
        for b0, b1 in blocks.tolist():
            c0 = b0
            while c0 < b1:
                c1 = _chunk_end(c0, min(c0 + chunk, b1), starts, parents)
                chunks.append(Chunk(c0, c1, tuple(_ancestor_ranges(c0, parents, run_start))))
                c0 = c1
        return cls(subtree_end=subtree_end, chunks=tuple(chunks))

    @property
    def tokens(self) -> int:
        return int(self.subtree_end.shape[0])

    @property
    def scored_pairs(self) -> int:
        """Query-key pairs the kernel computes (the chunks' rectangles): the work, and never ``N^2``."""
        return sum((c.q1 - c.q0) * c.keys for c in self.chunks)

    @property
    def nbytes(self) -> int:
        """Memory the mask holds: ``subtree_end`` plus the chunks' ranges (two 8-byte bounds each, as stored
        in a tensor; Python's tuples cost more but are as many)."""
        ranges = sum(len(c.ancestors) + 2 for c in self.chunks)
        return self.subtree_end.numel() * self.subtree_end.element_size() + 16 * ranges

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """``[1, H, N, D]`` queries, ``[1, Hkv, N, D]`` keys/values -> ``[1, N, H, D]`` (transformers' layout)."""
        if query.shape[0] != 1 or query.shape[2] != self.tokens:
            raise TrainerError(
                f"tree attention takes one flat sequence of {self.tokens} tokens, got queries {tuple(query.shape)}"
            )
        ends = self.subtree_end.to(query.device)
        recompute = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        outs = []
        for c in self.chunks:
            args = (query[:, :, c.q0 : c.q1], key, value, ends, c, scale)
            outs.append(checkpoint(_chunk, *args, use_reentrant=False) if recompute else _chunk(*args))
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


MIN_SPLIT = 16
"""A chunk ends early at a sibling branch only once it holds this many queries (no tiny chunks)."""


def _chunk_end(c0: int, c1: int, starts: np.ndarray, parents: list[int]) -> int:
    """End the chunk early where a branch starts that sees none of the chunk's earlier tokens (its parent lies
    before ``c0``): its queries would score those tokens only to mask them."""
    lo, hi = np.searchsorted(starts, [c0 + MIN_SPLIT, c1])
    for t in starts[lo:hi].tolist():
        if parents[t] < c0:
            return t
    return c1


def _ancestor_ranges(token: int, parents: list[int], run_start: list[int]) -> list[tuple[int, int]]:
    """The ancestors of ``token`` as ascending, disjoint ``[a, z)`` ranges, adjacent ones joined."""
    start = run_start[token]
    ranges = [(start, token)] if start < token else []
    up = parents[start]
    while up >= 0:
        start = run_start[up]
        ranges.append((start, up + 1))
        up = parents[start]
    joined: list[tuple[int, int]] = []
    for a, z in reversed(ranges):
        if joined and joined[-1][1] == a:
            joined[-1] = (joined[-1][0], z)
        else:
            joined.append((a, z))
    return joined


def _chunk(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ends: torch.Tensor,
    chunk: Chunk,
    scale: float,
) -> torch.Tensor:
    """Attention of one query chunk over its keys, masked by the tree rule."""
    device = query.device
    q_pos = torch.arange(chunk.q0, chunk.q1, device=device)
    if chunk.contiguous:
        k0 = chunk.ancestors[0][0] if chunk.ancestors else chunk.q0
        k, v = key[:, :, k0 : chunk.q1], value[:, :, k0 : chunk.q1]
        k_pos = torch.arange(k0, chunk.q1, device=device)
    else:
        k_pos = torch.cat([torch.arange(a, z, device=device) for a, z in chunk.ancestors] + [q_pos])
        k, v = key.index_select(2, k_pos), value.index_select(2, k_pos)
    allowed = (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] < ends[k_pos][None, :])
    return F.scaled_dot_product_attention(
        query, k, v, attn_mask=allowed, scale=scale, enable_gqa=query.shape[1] != k.shape[1]
    )


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tree: TreeMask | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: the model is called with ``tree=TreeMask`` and no attention mask.

    Called without a tree (a plain forward of the same model, e.g. to check it against HF) it is SDPA: no
    mask is built for this implementation, so that is plain causal attention."""
    if tree is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout:
        raise TrainerError("tree attention does not implement attention dropout; set attention_dropout = 0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return tree.attend(query, key, value, scale), None


def register() -> str:
    """Register the tree attention with transformers (idempotent); returns its implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, tree_attention_forward)
    return ATTN_IMPLEMENTATION
