"""A micro-batch as the trainer sees it: flat token tensors, attention blocks, and GSPO units.

Both batch forms (``gyre.trajectory.spec``) become the same shape here, so one forward path serves both:

* a **block** is a token range ``[start, end)`` that attends only within itself: a packed row splits into one
  block per root (its kept trajectories that share that root, tokens in depth-first order), an expanded row
  is one block (a plain causal sequence);
* every token has a **parent** (the previous token on its path; ``-1`` at a block's root): the logits at the
  parent predict the token, which for an expanded row is simply the previous position;
* ``subtree_end`` gives the tree mask: token ``i`` attends to ``j`` iff ``j <= i < subtree_end[j]``;
  for an expanded row every ``subtree_end`` is the row's end, which is the causal mask;
* a **unit** is the set of tokens one kept trajectory trains (``trajectory_ids`` in the packed form, the
  row's ``loss_mask`` tokens in the expanded form): the GSPO sequence ratio is taken per unit.

A unit never crosses a block (a trajectory is a root-to-leaf path), which is what lets the backend run
forward, loss and backward one group of blocks at a time without changing the result.

A packed micro-batch is also **shared** by default (``gyre.trajectory.share``): the rows' identical context
paths (a group's task prompt) become one path of one tree, so they are forwarded once; trained tokens are
never merged, so units, ratios and weights are those of the rows. ``tokens`` counts what is forwarded,
``row_tokens`` what the rows hold.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gyre.trainer.errors import BatchFormatError
from gyre.trajectory.share import share_context


@dataclass(frozen=True, eq=False)
class TrainBatch:
    """One micro-step's data; token tensors are int64/float32 copies, independent of the Arrow buffers."""

    form: str
    index: int
    """The micro-batch's running number from the builder (its micro-step within a step plan)."""
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent: torch.Tensor
    """Global index of each token's parent, ``-1`` at a block root."""
    subtree_end: torch.Tensor
    """Global index one past each token's subtree."""
    blocks: torch.Tensor
    """``[K, 2]`` int64 ``(start, end)`` of each attention block; blocks tile ``[0, tokens)`` in order."""
    trained: torch.Tensor
    """Global indices of the trained tokens (``loss_mask`` = 1), ascending."""
    unit_ids: torch.Tensor
    """Unit of each trained token, in ``[0, num_units)``."""
    num_units: int
    units: tuple[tuple[str, int], ...]
    """``(execution_id, rank)`` of each unit: the kept trajectory whose trained tokens it holds."""
    token_weights: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    execution_ids: tuple[str, ...]
    """Distinct executions in the micro-batch, in row order."""
    row_tokens: int = 0
    """Tokens of the rows before sharing (equals ``tokens`` when nothing is shared)."""

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def trained_tokens(self) -> int:
        return int(self.trained.shape[0])

    @property
    def weight(self) -> float:
        """Total token weight: the micro-batch's share of its step's loss normaliser."""
        return float(self.token_weights.sum())

    _TENSORS = ("input_ids", "position_ids", "parent", "subtree_end", "blocks", "trained", "unit_ids",
                "token_weights", "behaviour_logprobs", "advantages")

    def to_bytes(self) -> bytes:
        """The batch as safetensors (its tensors, the rest as JSON metadata): what a satellite is sent."""
        import json

        from safetensors.torch import save

        meta = {"form": self.form, "index": str(self.index), "num_units": str(self.num_units),
                "row_tokens": str(self.row_tokens), "units": json.dumps(self.units),
                "execution_ids": json.dumps(self.execution_ids)}
        return save({name: getattr(self, name).contiguous() for name in self._TENSORS}, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> "TrainBatch":
        """The batch ``to_bytes`` wrote; anything else is a ``BatchFormatError`` naming what is wrong."""
        import json

        from safetensors.torch import load

        try:
            tensors = load(data)
            header = int.from_bytes(data[:8], "little")  # safetensors: u64 header length, then the JSON header
            meta = json.loads(data[8:8 + header]).get("__metadata__") or {}
        except Exception as e:
            raise BatchFormatError(f"not a serialized TrainBatch: {e}") from e
        missing = [n for n in cls._TENSORS if n not in tensors]
        if missing or not {"form", "index", "num_units", "units", "execution_ids"} <= meta.keys():
            raise BatchFormatError(f"serialized TrainBatch lacks {missing or sorted(meta)}")
        return cls(form=meta["form"], index=int(meta["index"]), num_units=int(meta["num_units"]),
                   units=tuple((str(e), int(k)) for e, k in json.loads(meta["units"])),
                   execution_ids=tuple(json.loads(meta["execution_ids"])), row_tokens=int(meta.get("row_tokens", 0)),
                   **{n: tensors[n] for n in cls._TENSORS})

    @classmethod
    def from_micro_batch(cls, micro_batch: Any, index: int | None = None, *, share: bool = True) -> "TrainBatch":
        """From a ``gyre.trajectory.MicroBatch`` (either form); ``index`` overrides its running number."""
        return cls.from_columns(
            micro_batch.form, micro_batch.to_torch(), index=micro_batch.index if index is None else index, share=share
        )

    @classmethod
    def from_columns(
        cls, form: str, columns: Mapping[str, Any], index: int = 0, *, share: bool = True
    ) -> "TrainBatch":
        """From ``MicroBatch.to_torch()``-shaped columns: flat token tensors plus ``cu_seqlens``.

        ``share`` (packed form only) merges the rows' identical context paths into one tree."""
        if form not in ("packed", "expanded"):
            raise BatchFormatError(f"unknown batch form {form!r}; expected 'packed' or 'expanded'")
        for name in _required(form):
            if name not in columns:
                raise BatchFormatError(f"{form} micro-batch lacks column {name!r}")
        cu = columns["cu_seqlens"].long()
        n = int(cu[-1]) if cu.numel() else 0
        rows = cu.numel() - 1
        lengths = cu[1:] - cu[:-1]
        row_of = torch.repeat_interleave(torch.arange(rows), lengths)
        input_ids = columns["input_ids"].long()
        for name in ("input_ids", "position_ids", "loss_mask", "token_weights", "behaviour_logprobs", "advantages"):
            if columns[name].shape != (n,):
                raise BatchFormatError(f"column {name!r} has {columns[name].shape[0]} tokens, cu_seqlens says {n}")
        loss_mask = columns["loss_mask"].bool()
        trained = torch.nonzero(loss_mask).flatten()
        executions = list(columns["execution_id"])
        if form == "packed":
            parent, subtree_end, blocks, unit_ids, num_units = _packed(columns, cu, row_of, trained)
            counts = (columns["trajectory_ends_offsets"][1:] - columns["trajectory_ends_offsets"][:-1]).tolist()
            units = tuple((e, k) for e, count in zip(executions, counts, strict=True) for k in range(count))
        else:
            parent, subtree_end, blocks, unit_ids, num_units = _expanded(cu, row_of, trained, n)
            units = tuple(zip(executions, columns["trajectory_index"].tolist(), strict=True))
        if trained.numel() and bool((parent[trained] < 0).any()):
            bad = int(trained[parent[trained] < 0][0])
            raise BatchFormatError(
                f"token {bad} is trained (loss_mask=1) but starts its sequence: no earlier token predicts it"
            )
        position_ids = columns["position_ids"].long()
        token_weights = columns["token_weights"].float()[trained]
        behaviour = columns["behaviour_logprobs"].float()[trained]
        advantages = columns["advantages"].float()[trained]
        if form == "packed" and share and n:
            mergeable = ~loss_mask & (columns["behaviour_logprobs"] == 0)
            forest = share_context(parent.numpy(), input_ids.numpy(), position_ids.numpy(), mergeable.numpy())
            if forest is not None:
                source = torch.from_numpy(forest.source)
                input_ids, position_ids = input_ids[source], position_ids[source]
                parent = torch.from_numpy(forest.parent)
                subtree_end = torch.from_numpy(forest.subtree_end)
                roots = torch.nonzero(parent < 0).flatten()
                blocks = torch.stack([roots, subtree_end[roots]], dim=1)
                moved, order = torch.sort(torch.from_numpy(forest.node)[trained])
                trained, unit_ids = moved, unit_ids[order]
                token_weights, behaviour, advantages = token_weights[order], behaviour[order], advantages[order]
        return cls(
            form=form,
            index=index,
            input_ids=input_ids,
            position_ids=position_ids,
            parent=parent,
            subtree_end=subtree_end,
            blocks=blocks,
            trained=trained,
            unit_ids=unit_ids,
            num_units=num_units,
            units=units,
            token_weights=token_weights,
            behaviour_logprobs=behaviour,
            advantages=advantages,
            execution_ids=tuple(dict.fromkeys(executions)),
            row_tokens=n,
        )


def _required(form: str) -> tuple[str, ...]:
    common = (
        "cu_seqlens", "execution_id", "input_ids", "position_ids", "loss_mask", "token_weights",
        "behaviour_logprobs", "advantages",
    )
    if form == "packed":
        return (*common, "parent_ids", "subtree_end", "trajectory_ids", "trajectory_ends_offsets")
    return (*common, "trajectory_index")


def _packed(
    columns: Mapping[str, Any], cu: torch.Tensor, row_of: torch.Tensor, trained: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    n = row_of.numel()
    base = cu[:-1][row_of]
    local_parent = columns["parent_ids"].long()
    parent = torch.where(local_parent >= 0, local_parent + base, torch.full_like(local_parent, -1))
    subtree_end = columns["subtree_end"].long() + base
    ar = torch.arange(n)
    if n and bool(((parent >= ar) | (subtree_end <= ar) | (subtree_end > cu[1:][row_of])).any()):
        raise BatchFormatError("packed micro-batch: parent_ids/subtree_end are not a depth-first tree within each row")
    child = torch.nonzero(parent >= 0).flatten()
    outer = subtree_end[parent[child]]
    if bool(((child >= outer) | (subtree_end[child] > outer)).any()):  # a subtree must nest in its parent's
        raise BatchFormatError("packed micro-batch: a token's subtree_end does not nest inside its parent's")
    roots = torch.nonzero(local_parent < 0).flatten()
    blocks = torch.stack([roots, subtree_end[roots]], dim=1) if n else torch.zeros(0, 2, dtype=torch.long)
    if n and not (
        int(blocks[0, 0]) == 0 and int(blocks[-1, 1]) == n and bool((blocks[1:, 0] == blocks[:-1, 1]).all())
    ):
        raise BatchFormatError("packed micro-batch: the root subtrees do not tile the rows (subtree_end of a root)")
    owner = columns["trajectory_ids"].long()[trained]
    if bool((owner < 0).any()):
        raise BatchFormatError("packed micro-batch: a trained token has trajectory_ids = -1")
    traj_offsets = columns["trajectory_ends_offsets"].long()
    counts = traj_offsets[1:] - traj_offsets[:-1]
    rows_of_trained = row_of[trained]
    if bool((owner >= counts[rows_of_trained]).any()):
        raise BatchFormatError("packed micro-batch: trajectory_ids exceeds the row's kept trajectories")
    unit_ids = traj_offsets[:-1][rows_of_trained] + owner
    return parent, subtree_end, blocks, unit_ids, int(traj_offsets[-1]) if traj_offsets.numel() else 0


def _expanded(
    cu: torch.Tensor, row_of: torch.Tensor, trained: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    ar = torch.arange(n)
    starts = cu[:-1]
    parent = ar - 1
    nonempty = starts[cu[1:] > starts]
    parent[nonempty] = -1
    subtree_end = cu[1:][row_of]
    blocks = torch.stack([starts, cu[1:]], dim=1)
    blocks = blocks[blocks[:, 1] > blocks[:, 0]]
    return parent, subtree_end, blocks, row_of[trained], cu.numel() - 1
