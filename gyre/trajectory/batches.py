"""Micro-batches: rows packed into token budgets and written straight into Arrow-ready buffers.

Row lengths are known before any token is copied (packed: the kept tree's size; expanded: the kept
trajectory's length), so rows are binned first (first-fit decreasing within a group) and each bin's
buffers are allocated once and filled in place. With ``share_prefixes`` (packed form) a bin counts what the
trainer will forward: a row's leading prompt shared with a row already in the bin is counted once
(``gyre.trajectory.share``), so the 16 rollouts of a group with a 49K-token prompt fit one budget.
The Arrow arrays wrap those numpy buffers without copies, and ``to_torch`` wraps the Arrow buffers without
copies.
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from gyre.events.fields import BranchKind
from gyre.trajectory import layout as layouts
from gyre.trajectory.calls import BRANCHES
from gyre.trajectory.config import BatchForm
from gyre.trajectory.rewards import ExecutionOutcome
from gyre.trajectory.selection import Selection
from gyre.trajectory.share import shared_length
from gyre.trajectory.spec import columns, schema

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, eq=False)
class ExecutionPlan:
    """A valid execution, ready to lay out: kept trajectories, advantage and per-token weight."""

    outcome: ExecutionOutcome
    selection: Selection
    advantage: float
    token_weight: float
    """Weight of each trained token: ``total_weight / policy_tokens_trained``."""

    @property
    def branches(self) -> list[BranchKind]:
        calls = self.selection.tree.calls
        return [BRANCHES[calls.branch[e]] for e in self.selection.kept]


@dataclass(frozen=True)
class Row:
    """One row to emit: an execution (packed) or one of its kept trajectories (expanded)."""

    plan: ExecutionPlan
    rank: int
    """Kept trajectory for expanded rows; -1 for packed rows."""
    length: int
    prefix: np.ndarray | None = None
    """Packed rows that may share: the row's leading context tokens (its first call's prompt)."""


def rows(plans: Sequence[ExecutionPlan], form: BatchForm, share: bool = False) -> list[Row]:
    out = []
    for plan in plans:
        selection = plan.selection
        if form == "packed":
            prefix = layouts.leading_context(selection) if share else None
            out.append(Row(plan, -1, selection.tokens_packed, prefix))
        else:
            lengths = selection.tree.full_len[selection.kept]
            out.extend(Row(plan, r, int(length)) for r, length in enumerate(lengths))
    return out


def bins(lengths: Sequence[int], budget: int, prefixes: Sequence[np.ndarray] | None = None) -> list[list[int]]:
    """First-fit decreasing: row indices per bin, each bin within ``budget`` unless one row alone exceeds it.

    With ``prefixes`` (each row's leading context) a row costs its length less the longest leading context
    it shares with a row already in the bin. Rows keep their original order inside a bin; bins come out in
    the order they were opened.
    """
    opened: list[tuple[int, list[int]]] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, (used, members) in enumerate(opened):
            length = lengths[index] if prefixes is None else shared_length(lengths, prefixes, members, index)
            if used + length <= budget:
                members.append(index)
                opened[b] = (used + length, members)
                break
        else:
            opened.append((lengths[index], [index]))
    return [sorted(members) for _, members in opened]


def balanced(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """Exactly ``parts`` bins (some empty when there are fewer rows): longest row first into the lightest bin
    (ties: the first), rows in their original order inside a bin. The simulator cuts a group this way."""
    loads = [0] * parts
    members: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = loads.index(min(loads))
        loads[b] += lengths[index]
        members[b].append(index)
    return [sorted(m) for m in members]


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """One micro-step's worth of rows, in either form; columns as in ``gyre.trajectory.spec``."""

    form: BatchForm
    index: int
    """Running number within the build (the order micro-steps can be claimed in)."""
    batch: pa.RecordBatch
    group_ids: tuple[str, ...]
    forward_bound: int = 0
    """Tokens the trainer forwards at most: the rows' tokens, less the leading prompts they share (packed
    form with ``share_prefixes``; the trainer's merge may share more)."""

    @property
    def tokens(self) -> int:
        return len(self.batch.column("input_ids").values)

    @property
    def rows(self) -> int:
        return self.batch.num_rows

    @property
    def executions(self) -> int:
        return len(set(self.batch.column("execution_id").to_pylist()))

    def to_torch(self) -> dict[str, Any]:
        """Token columns as flat tensors sharing the Arrow buffers, plus ``cu_seqlens`` from the offsets.

        Parent and subtree indices stay local to their row; add ``cu_seqlens[row]`` for global indices.
        ``loss_mask`` comes back as ``torch.bool``. String columns stay Python lists.
        """
        import torch

        out: dict[str, Any] = {}
        first = self.batch.column("input_ids")
        out["cu_seqlens"] = _tensor(first.offsets, torch.int32)
        for column in columns(self.form):
            array = self.batch.column(column.name)
            if column.per == "row":
                out[column.name] = (
                    array.to_pylist() if pa.types.is_string(column.type) else _tensor(array, _torch_dtype(column.type))
                )
            elif pa.types.is_string(column.type):
                out[column.name] = array.to_pylist()
            else:
                out[column.name] = _tensor(array.flatten(), _torch_dtype(column.type))
                if column.per == "trajectory":
                    out[f"{column.name}_offsets"] = _tensor(array.offsets, torch.int32)
        out["loss_mask"] = out["loss_mask"].view(torch.bool)
        return out


def _torch_dtype(arrow_type: pa.DataType) -> "torch.dtype":
    import torch

    return {pa.int32(): torch.int32, pa.uint8(): torch.uint8, pa.float32(): torch.float32}[arrow_type]


def _tensor(array: pa.Array, dtype: "torch.dtype") -> "torch.Tensor":
    import torch

    if len(array) == 0:
        return torch.empty(0, dtype=dtype)
    width = array.type.bit_width // 8
    return torch.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * width)


def fill(chosen: Sequence[Row], form: BatchForm) -> pa.RecordBatch:
    """One micro-batch from rows: allocate every token column once, fill each row's slice in place."""
    lengths = np.array([row.length for row in chosen], dtype=np.int64)
    offsets = np.zeros(len(chosen) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    token_columns = [c for c in columns(form) if c.per == "token"]
    buffers = {c.name: np.empty(total, dtype=c.type.to_pandas_dtype()) for c in token_columns}
    trajectory_ends: list[np.ndarray] = []
    branches: list[list[str]] = []
    for i, row in enumerate(chosen):
        plan = row.plan
        lay = layouts.packed(plan.selection) if form == "packed" else layouts.expanded(plan.selection, row.rank)
        piece = slice(int(offsets[i]), int(offsets[i + 1]))
        lay.write({name: buffer[piece] for name, buffer in buffers.items()}, plan.token_weight, plan.advantage)
        if form == "packed":
            assert lay.trajectory_ends is not None
            trajectory_ends.append(lay.trajectory_ends)
            branches.append(list(plan.branches))
    offsets_array = pa.array(offsets, pa.int32())
    arrays: dict[str, pa.Array] = {
        "execution_id": pa.array([row.plan.outcome.execution_id for row in chosen], pa.string()),
        "group_id": pa.array([row.plan.outcome.group_id for row in chosen], pa.string()),
        "task_id": pa.array([row.plan.outcome.task_id or "" for row in chosen], pa.string()),
        "reward": pa.array([row.plan.outcome.reward for row in chosen], pa.float32()),
    }
    for name, values in buffers.items():
        arrays[name] = pa.ListArray.from_arrays(offsets_array, pa.array(values))
    if form == "packed":
        counts = np.array([len(e) for e in trajectory_ends], dtype=np.int32)
        traj_offsets = pa.array(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))
        flat_ends = np.concatenate(trajectory_ends) if trajectory_ends else np.zeros(0, np.int32)
        arrays["trajectory_ends"] = pa.ListArray.from_arrays(traj_offsets, pa.array(flat_ends, pa.int32()))
        arrays["trajectory_branches"] = pa.ListArray.from_arrays(
            traj_offsets, pa.array([b for names in branches for b in names], pa.string())
        )
    else:
        arrays["trajectory_index"] = pa.array([row.rank for row in chosen], pa.int32())
        arrays["branch"] = pa.array([row.plan.branches[row.rank] for row in chosen], pa.string())
    target = schema(form)
    return pa.RecordBatch.from_arrays([arrays[f.name] for f in target], schema=target)


def micro_batches(
    plans: Sequence[ExecutionPlan], form: BatchForm, budget: int, first_index: int = 0, *, share: bool = False,
    parts: int | None = None,
) -> Iterator[tuple[MicroBatch, bool]]:
    """Micro-batches of one group's plans, each with whether it holds a single over-budget row.

    ``share`` (packed form): bin by forwarded tokens, a leading prompt shared within a bin counted once.
    ``parts``: exactly that many micro-batches (`balanced`), the budget not consulted."""
    all_rows = rows(plans, form, share=share and form == "packed")
    lengths = [row.length for row in all_rows]
    prefixes = [row.prefix for row in all_rows] if share and form == "packed" else None
    cut = balanced(lengths, parts) if parts is not None else bins(lengths, budget, prefixes)  # type: ignore[arg-type]
    for n, members in enumerate(cut):
        chosen = [all_rows[i] for i in members]
        oversized = len(chosen) == 1 and chosen[0].length > budget
        groups = tuple(dict.fromkeys(row.plan.outcome.group_id or "" for row in chosen))
        bound = sum(
            lengths[m] if prefixes is None else shared_length(lengths, prefixes, members[:k], m)
            for k, m in enumerate(members)
        )
        yield MicroBatch(form, first_index + n, fill(chosen, form), groups, bound), oversized
