"""Forward passes over attention blocks: flat passes with sparse tree attention, or padded dense ones.

Two plans, one ``forward_backward``:

* ``plan_tree`` (the torch backend's default): consecutive blocks concatenated into one flat ``[1, N]``
  sequence of at most ``max_tokens`` tokens, no padding, attention through ``TreeMask`` (linear memory; see
  ``gyre.trainer.tree_attention``). A block longer than ``max_tokens`` gets a pass of its own.
* ``plan`` (dense: the Megatron adapter, and the torch backend's ``attention = "dense"`` reference): blocks
  padded into ``[B, L]`` groups with an explicit ``[B, L, L]`` mask.

The dense plan: a micro-batch's blocks (see ``gyre.trainer.batch``) are grouped into passes of similar
length, each padded to ``[B, L]``. Grouping bounds both the padded tokens (``B * L``: activations of the
projections and MLP) and the attention area (``B * L * L``: the score matrix an eager kernel
materialises), and stops adding a block once padding would exceed a quarter of the pass.

The mask of a block is the tree mask from ``subtree_end``: query ``i`` sees key ``j`` iff
``j <= i < subtree_end[j]``. A padding position sees only itself, so no softmax row is empty.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gyre.trainer.batch import TrainBatch
from gyre.trainer.config import GSPOConfig
from gyre.trainer.loss import LossStats, gspo_loss
from gyre.trainer.protocol import MicroStepResult
from gyre.trainer.tree_attention import TreeMask

MIN_FILL = 0.75
"""A block joins a pass only if real tokens stay at least this share of the pass's padded tokens."""


@dataclass(frozen=True, eq=False)
class ForwardPass:
    """One padded forward pass: which blocks, and which trained tokens it scores."""

    blocks: tuple[int, ...]
    length: int
    """Padded length ``L`` (the longest block)."""
    input_ids: torch.Tensor
    """``[B, L]``"""
    position_ids: torch.Tensor
    """``[B, L]``"""
    allowed: torch.Tensor
    """``[B, L, L]`` bool: query ``i`` may attend to key ``j``."""
    trained: torch.Tensor
    """Positions (into the batch's trained-token columns) of the trained tokens in these blocks."""
    parent_slots: torch.Tensor
    """Flat ``B * L`` slot of each such token's parent: the hidden state whose logits predict it."""
    targets: torch.Tensor
    """Token id of each such token."""

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """``[B, 1, L, L]`` mask to add to attention scores: 0 where allowed, the dtype's minimum elsewhere."""
        mask = torch.zeros(self.allowed.shape, dtype=dtype)
        mask.masked_fill_(~self.allowed, torch.finfo(dtype).min)
        return mask[:, None]

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def attention_area(self) -> int:
        return int(self.input_ids.shape[0]) * self.length * self.length


def group_blocks(lengths: Sequence[int], max_tokens: int, max_area: int) -> list[list[int]]:
    """Blocks grouped into passes: longest first, each pass within ``max_tokens`` padded tokens, ``max_area``
    attention pairs and ``MIN_FILL`` fill (a block over the limits gets a pass of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    passes: list[list[int]] = []
    current: list[int] = []
    longest = real = 0
    for i in order:
        n = lengths[i]
        if current:
            count = len(current) + 1
            fits = count * longest <= max_tokens and count * longest * longest <= max_area
            if fits and (real + n) >= MIN_FILL * count * longest:
                current.append(i)
                real += n
                continue
            passes.append(current)
        current, longest, real = [i], n, n
    if current:
        passes.append(current)
    return passes


def plan(batch: TrainBatch, max_tokens: int, max_area: int) -> list[ForwardPass]:
    """The forward passes of a micro-batch (every block in exactly one pass)."""
    starts = batch.blocks[:, 0].contiguous()
    ends = batch.blocks[:, 1].contiguous()
    lengths = (ends - starts).tolist()
    # trained tokens are ascending and blocks tile the batch in order: each block owns one contiguous range
    lo = torch.searchsorted(batch.trained, starts).tolist()
    hi = torch.searchsorted(batch.trained, ends).tolist()
    return [
        _build(batch, members, [lengths[m] for m in members], lo, hi)
        for members in group_blocks(lengths, max_tokens, max_area)
    ]


def _build(batch: TrainBatch, members: list[int], lengths: list[int], lo: list[int], hi: list[int]) -> ForwardPass:
    b, length = len(members), max(lengths)
    input_ids = torch.zeros(b, length, dtype=torch.long)
    position_ids = torch.zeros(b, length, dtype=torch.long)
    ar = torch.arange(length)
    local_end = (ar + 1).repeat(b, 1)  # padding: a key visible to its own query only
    trained_parts, slot_parts = [], []
    for slot, (block, n) in enumerate(zip(members, lengths, strict=True)):
        start = int(batch.blocks[block, 0])
        input_ids[slot, :n] = batch.input_ids[start : start + n]
        position_ids[slot, :n] = batch.position_ids[start : start + n]
        if n < length:  # pad positions continue the last real one, so rotary tables stay small
            position_ids[slot, n:] = position_ids[slot, n - 1] + 1 + torch.arange(length - n)
        local_end[slot, :n] = batch.subtree_end[start : start + n] - start
        mine = torch.arange(lo[block], hi[block])
        trained_parts.append(mine)
        slot_parts.append(slot * length + batch.parent[batch.trained[mine]] - start)
    allowed = (ar[None, None, :] <= ar[None, :, None]) & (ar[None, :, None] < local_end[:, None, :])
    trained = torch.cat(trained_parts)
    return ForwardPass(
        blocks=tuple(members),
        length=length,
        input_ids=input_ids,
        position_ids=position_ids,
        allowed=allowed,
        trained=trained,
        parent_slots=torch.cat(slot_parts),
        targets=batch.input_ids[batch.trained[trained]],
    )


@dataclass(frozen=True, eq=False)
class TreePass:
    """One flat forward pass: consecutive blocks as a single ``[1, N]`` sequence under a ``TreeMask``."""

    blocks: tuple[int, ...]
    input_ids: torch.Tensor
    """``[1, N]``"""
    position_ids: torch.Tensor
    """``[1, N]``"""
    tree: TreeMask
    trained: torch.Tensor
    """Positions (into the batch's trained-token columns) of the trained tokens in these blocks."""
    parent_slots: torch.Tensor
    """Index (within the pass) of each such token's parent."""
    targets: torch.Tensor

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def attention_area(self) -> int:
        return self.tree.scored_pairs


Pass = ForwardPass | TreePass


def plan_tree(batch: TrainBatch, max_tokens: int, chunk: int) -> list[TreePass]:
    """Flat passes of consecutive blocks, each within ``max_tokens`` tokens unless one block alone exceeds it."""
    bounds = batch.blocks.tolist()
    groups: list[list[int]] = []
    size = 0
    for i, (start, end) in enumerate(bounds):
        if groups and size + (end - start) <= max_tokens:
            groups[-1].append(i)
            size += end - start
        else:
            groups.append([i])
            size = end - start
    passes: list[TreePass] = []
    for members in groups:
        start, end = bounds[members[0]][0], bounds[members[-1]][1]
        lo, hi = (int(x) for x in torch.searchsorted(batch.trained, torch.tensor([start, end])))
        trained = torch.arange(lo, hi)
        local_blocks = torch.tensor([bounds[m] for m in members], dtype=torch.long) - start
        parent = batch.parent[start:end]
        local_parent = torch.where(parent >= 0, parent - start, parent)
        passes.append(TreePass(
            blocks=tuple(members),
            input_ids=batch.input_ids[start:end][None],
            position_ids=batch.position_ids[start:end][None],
            tree=TreeMask.build(local_parent, batch.subtree_end[start:end] - start, local_blocks, chunk),
            trained=trained,
            parent_slots=batch.parent[batch.trained[lo:hi]] - start,
            targets=batch.input_ids[batch.trained[lo:hi]],
        ))
    return passes


def forward_backward(
    batch: TrainBatch,
    logprobs_of: Callable[[Pass], torch.Tensor],
    passes: Sequence[Pass],
    *,
    loss: GSPOConfig,
    device: str,
    loss_scale: float = 1.0,
) -> MicroStepResult:
    """Forward, GSPO loss and backward pass by pass, accumulating gradients: what every backend does with a
    micro-batch's ``passes``, whatever computes the trained tokens' log-probs (``logprobs_of``, in trained
    order)."""
    started = time.perf_counter()
    stats = LossStats()
    padded = count = 0
    for group in passes:
        if group.trained.numel() == 0:
            continue
        picked = group.trained
        loss_sum, part = gspo_loss(
            logprobs_of(group),
            batch.behaviour_logprobs[picked].to(device),
            batch.advantages[picked].to(device),
            batch.token_weights[picked].to(device),
            batch.unit_ids[picked].to(device),
            batch.num_units,
            loss,
        )
        (loss_sum * loss_scale).backward()
        stats = stats + part
        padded += group.padded_tokens
        count += 1
    return MicroStepResult(
        index=batch.index,
        tokens=batch.tokens,
        padded_tokens=padded,
        passes=count,
        stats=stats,
        duration_s=time.perf_counter() - started,
        trained_tokens=batch.trained_tokens,
    )
