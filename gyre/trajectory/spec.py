"""The batch format the trainer consumes: every column, its Arrow type, its granularity and meaning.

Two forms share the token columns:

* ``packed`` — one row per execution: its kept trajectories as one tree, every shared prefix stored once.
  Tokens are in depth-first order, so a token's parent comes before it and the subtree of token ``j`` is
  the range ``[j, subtree_end[j])``. Token ``i`` may attend to token ``j`` exactly when
  ``j <= i < subtree_end[j]`` (equivalently: ``j`` is ``i`` or an ancestor of ``i`` by ``parent_ids``).
* ``expanded`` — one row per kept trajectory, plain causal sequences; the reference the packed form must
  match: the same trained tokens, with the same weights, trained once in total.

Token columns are ``list<T>`` whose values are one flat buffer per micro-batch (the "varlen"/THD
layout); row offsets give ``cu_seqlens``. All fixed-width, no nulls, so torch views them without copies.
"""

from dataclasses import dataclass
from typing import Literal

import pyarrow as pa

from gyre.trajectory.config import BatchForm

Granularity = Literal["row", "token", "trajectory"]


@dataclass(frozen=True)
class Column:
    """One batch column: ``per`` says whether it holds a value per row, per token, or per kept trajectory."""

    name: str
    type: pa.DataType
    per: Granularity
    doc: str

    @property
    def arrow_type(self) -> pa.DataType:
        return self.type if self.per == "row" else pa.list_(self.type)


_ROW = (
    Column("execution_id", pa.string(), "row", "execution the row comes from"),
    Column("group_id", pa.string(), "row", "GSPO group (the executions of one task sampled together)"),
    Column("task_id", pa.string(), "row", "task of the group"),
    Column("reward", pa.float32(), "row", "the execution's reward (timed out: scored on its preserved workspace)"),
)
_TOKENS = (
    Column("input_ids", pa.int32(), "token", "token ids"),
    Column("position_ids", pa.int32(), "token", "position of the token in its own sequence (depth in the tree)"),
    Column(
        "loss_mask",
        pa.uint8(),
        "token",
        "1 for a policy token trained here (owned by this row's trajectory), 0 for context or a token "
        "trained by a higher-ranked trajectory",
    ),
    Column(
        "token_weights",
        pa.float32(),
        "token",
        "loss weight; 0 where loss_mask is 0; the weights of one execution sum to total_weight",
    ),
    Column(
        "behaviour_logprobs",
        pa.float32(),
        "token",
        "log-prob of the token under the policy that sampled it (0 for context tokens)",
    ),
    Column("advantages", pa.float32(), "token", "the execution's group-normalised advantage"),
    Column("policy_versions", pa.int32(), "token", "policy version of the call that produced or received it"),
)

PACKED_COLUMNS: tuple[Column, ...] = (
    *_ROW,
    *_TOKENS,
    Column("parent_ids", pa.int32(), "token", "index (within the row) of the previous token on its path; -1 at a root"),
    Column("subtree_end", pa.int32(), "token", "one past the last index of the token's subtree (see module doc)"),
    Column("trajectory_ids", pa.int32(), "token", "rank of the kept trajectory that trains the token; -1 if none"),
    Column("trajectory_ends", pa.int32(), "trajectory", "index of the last token of each kept trajectory, by rank"),
    Column("trajectory_branches", pa.string(), "trajectory", "branch of each kept trajectory's end call, by rank"),
)
"""Columns of the tree-packed form (one row per execution)."""

EXPANDED_COLUMNS: tuple[Column, ...] = (
    *_ROW,
    Column("trajectory_index", pa.int32(), "row", "rank of the trajectory within its execution (0 = best)"),
    Column("branch", pa.string(), "row", "branch of the trajectory's end call"),
    *_TOKENS,
)
"""Columns of the expanded reference form (one row per kept trajectory)."""


def columns(form: BatchForm) -> tuple[Column, ...]:
    return PACKED_COLUMNS if form == "packed" else EXPANDED_COLUMNS


def schema(form: BatchForm) -> pa.Schema:
    """Arrow schema of a micro-batch of ``form``; fields are non-nullable."""
    return pa.schema(
        [pa.field(c.name, c.arrow_type, nullable=False) for c in columns(form)],
        metadata={b"gyre.trajectory.form": form.encode()},
    )
