"""One execution's model calls as flat arrays, with every recorded token stored exactly once.

A call's *segment* is what it adds to its parent's prefix: its prompt delta (context) followed by its
output (policy tokens). The segments of all calls lie back to back in one ``tokens`` buffer, so the full
sequence of any call is a list of (call, length) spans into that buffer — never a copy of its prefix.
Rows are copied out of the log's batches once, as ``CallFragment``s, so the batches can be let go.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gyre.events.fields import BranchKind
from gyre.events.models import ModelCallFinished
from gyre.trajectory.errors import TrajectoryError

BRANCHES: tuple[BranchKind, ...] = ("main", "main-summary", "sub-agent", "sub-agent-summary")
"""Branch kinds in rank order: main > main-summary > sub-agent > sub-agent-summary (index = rank).

Spelled out rather than read from ``BranchKind``, so that the ranking cannot change with the order of the
vocabulary's literal; a test fails if the vocabulary gains a kind this ranking does not place."""

CALL_COLUMNS: tuple[str, ...] = (
    "call_id",
    "parent_call_id",
    "branch",
    "prefix_len",
    "prompt_delta_ids",
    "output_ids",
    "output_logprobs",
    "policy_version",
    "seq",
)
"""Columns of the ``model_calls`` view that trajectories are built from."""

_META_COLUMNS = ["call_id", "parent_call_id", "branch", "prefix_len", "policy_version", "seq"]
_TOKEN_LIST = pa.list_(pa.int32())
_LOGPROB_LIST = pa.list_(pa.float32())


@dataclass(frozen=True, eq=False)
class CallFragment:
    """Some calls of one execution, copied out of a batch of ``model_calls`` rows.

    The log source cuts one per (batch, execution) as rows stream by, so that every batch can be let go
    at once; ``ExecutionCalls.from_fragments`` joins them. A data problem found here (a log-prob count
    that does not match, an unknown branch) is kept, not raised, so that the builder can exclude the
    execution and count it as malformed.
    """

    call_ids: list[str]
    parent_ids: list[str | None]
    branch: np.ndarray
    """int8 index into ``BRANCHES``; -1 for a branch name the vocabulary does not know."""
    prefix_len: np.ndarray
    version: np.ndarray
    seq: np.ndarray
    """-1 where unknown (calls not read from a log)."""
    delta_len: np.ndarray
    out_len: np.ndarray
    tokens: np.ndarray
    """Each call's prompt delta then its output, back to back (int32)."""
    logprobs: np.ndarray
    """Behaviour log-probs of the outputs only, back to back (float32)."""
    problem: str | None = None

    @classmethod
    def broken(cls, problem: str) -> "CallFragment":
        """A fragment that only carries a problem, which makes its execution malformed."""
        empty = np.zeros(0, dtype=np.int64)
        return cls(
            call_ids=[],
            parent_ids=[],
            branch=empty.astype(np.int8),
            prefix_len=empty,
            version=empty,
            seq=empty,
            delta_len=empty,
            out_len=empty,
            tokens=np.zeros(0, np.int32),
            logprobs=np.zeros(0, np.float32),
            problem=problem,
        )

    @classmethod
    def from_rows(cls, batch: pa.RecordBatch, rows: np.ndarray | None = None) -> "CallFragment":
        """Copy rows ``rows`` (default: all) of a batch with the ``CALL_COLUMNS``; one copy of each token."""
        missing = [name for name in CALL_COLUMNS if name not in batch.schema.names]
        if missing:
            raise TrajectoryError(f"model call rows lack column(s) {missing}; select {list(CALL_COLUMNS)}")
        rows = np.arange(batch.num_rows) if rows is None else np.asarray(rows, dtype=np.int64)
        meta = batch.select(_META_COLUMNS).take(pa.array(rows))
        call_ids = meta.column("call_id").to_pylist()
        branch = pc.index_in(meta.column("branch").fill_null("main"), value_set=pa.array(BRANCHES))
        problem = None
        if branch.null_count:
            bad = pc.filter(meta.column("branch"), branch.is_null())[0].as_py()
            problem = f"a call has branch {bad!r}; expected one of {list(BRANCHES)}"
        d_off, d_val = _list_parts(batch.column("prompt_delta_ids"), np.int32)
        o_off, o_val = _list_parts(batch.column("output_ids"), np.int32)
        l_off, l_val = _list_parts(batch.column("output_logprobs"), np.float32)
        d_lo, d_hi, o_lo, o_hi, l_lo, l_hi = (
            d_off[rows],
            d_off[rows + 1],
            o_off[rows],
            o_off[rows + 1],
            l_off[rows],
            l_off[rows + 1],
        )
        bad_lp = np.flatnonzero((o_hi - o_lo) != (l_hi - l_lo))
        if len(bad_lp) and problem is None:
            i = int(bad_lp[0])
            problem = (
                f"call {call_ids[i]!r} has {l_hi[i] - l_lo[i]} output_logprobs for {o_hi[i] - o_lo[i]} "
                f"output_ids; they must match one to one"
            )
        token_parts: list[np.ndarray] = []
        for a, b, c, d in zip(d_lo.tolist(), d_hi.tolist(), o_lo.tolist(), o_hi.tolist(), strict=True):
            token_parts.append(d_val[a:b])
            token_parts.append(o_val[c:d])
        logprob_parts = [l_val[a:b] for a, b in zip(l_lo.tolist(), l_hi.tolist(), strict=True)]
        return cls(
            call_ids=call_ids,
            parent_ids=meta.column("parent_call_id").to_pylist(),
            branch=_ints(branch, np.int8, fill=-1),
            prefix_len=_ints(meta.column("prefix_len"), np.int64),
            version=_ints(meta.column("policy_version"), np.int64),
            seq=_ints(meta.column("seq"), np.int64, fill=-1),
            delta_len=d_hi - d_lo,
            out_len=o_hi - o_lo,
            tokens=np.concatenate(token_parts) if token_parts else np.zeros(0, np.int32),
            logprobs=np.concatenate(logprob_parts) if logprob_parts else np.zeros(0, np.float32),
            problem=problem,
        )


@dataclass(frozen=True, eq=False)
class ExecutionCalls:
    """The model calls of one execution, columnar, indexed ``0..n-1`` in arrival order.

    ``tokens[seg_start[i]:seg_start[i + 1]]`` is call ``i``'s segment; its first ``delta_len[i]`` tokens are
    context, the rest are policy tokens, whose behaviour log-probs are ``logprobs[out_start[i]:out_start[i
    + 1]]``. Only the outputs carry log-probs, so the arrays hold no more than the log does.
    """

    execution_id: str
    call_ids: tuple[str, ...]
    parent: np.ndarray
    """int32 index of the parent call, -1 for a call without parent."""
    branch: np.ndarray
    """int8 index into ``BRANCHES`` (which is also the rank: lower is better)."""
    prefix_len: np.ndarray
    delta_len: np.ndarray
    seg_start: np.ndarray
    """int64, ``n + 1`` offsets into ``tokens``."""
    out_start: np.ndarray
    """int64, ``n + 1`` offsets into ``logprobs``."""
    seq: np.ndarray
    version: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray

    @property
    def n(self) -> int:
        return len(self.call_ids)

    @cached_property
    def seg_len(self) -> np.ndarray:
        return np.diff(self.seg_start)

    @property
    def num_tokens(self) -> int:
        return int(self.seg_start[-1])

    @property
    def num_policy_tokens(self) -> int:
        return int(self.out_start[-1])

    def policy_mask(self) -> np.ndarray:
        """Per token of ``tokens``: whether it is a policy (output) token."""
        offset = np.arange(self.num_tokens) - np.repeat(self.seg_start[:-1], self.seg_len)
        return offset >= np.repeat(self.delta_len, self.seg_len)

    def token_logprobs(self) -> np.ndarray:
        """Behaviour log-prob per token of ``tokens`` (0 for context tokens)."""
        out = np.zeros(self.num_tokens, dtype=np.float32)
        out[self.policy_mask()] = self.logprobs
        return out

    # -- construction ------------------------------------------------------------------------------------

    @classmethod
    def from_fragments(cls, execution_id: str, fragments: Sequence[CallFragment]) -> "ExecutionCalls":
        """Join the fragments of one execution and resolve parent links; bad data raises ``TrajectoryError``."""
        if not fragments:
            raise TrajectoryError(f"execution {execution_id!r} has no model call rows")
        for fragment in fragments:
            if fragment.problem is not None:
                raise TrajectoryError(f"execution {execution_id!r}: {fragment.problem}")
        call_ids = tuple(c for f in fragments for c in f.call_ids)
        n = len(call_ids)
        index = {call_id: i for i, call_id in enumerate(call_ids)}
        if len(index) != n:
            twice = next(c for c, count in Counter(call_ids).items() if count > 1)
            raise TrajectoryError(f"execution {execution_id!r} records call {twice!r} more than once")
        parent = np.full(n, -1, dtype=np.int32)
        for i, parent_id in enumerate(p for f in fragments for p in f.parent_ids):
            if parent_id is None:
                continue
            found = index.get(parent_id)
            if found is None:
                raise TrajectoryError(
                    f"call {call_ids[i]!r} of execution {execution_id!r} names parent {parent_id!r}, "
                    f"which is not a call of that execution"
                )
            parent[i] = found

        def joined(name: str) -> np.ndarray:
            parts = [getattr(f, name) for f in fragments]
            return parts[0] if len(parts) == 1 else np.concatenate(parts)

        seq = joined("seq")
        if (seq < 0).any():
            seq = np.where(seq < 0, np.arange(n), seq)  # calls not read from a log: arrival order
        delta_len, out_len = joined("delta_len"), joined("out_len")
        seg_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(delta_len + out_len, out=seg_start[1:])
        out_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(out_len, out=out_start[1:])
        return cls(
            execution_id=execution_id,
            call_ids=call_ids,
            parent=parent,
            branch=joined("branch"),
            prefix_len=joined("prefix_len"),
            delta_len=delta_len.astype(np.int64),
            seg_start=seg_start,
            out_start=out_start,
            seq=seq,
            version=joined("version"),
            tokens=joined("tokens"),
            logprobs=joined("logprobs"),
        )

    @classmethod
    def from_arrow(cls, execution_id: str, rows: "pa.Table | pa.RecordBatch") -> "ExecutionCalls":
        """Build from rows of the ``model_calls`` view (``CALL_COLUMNS``; any chunking, any row order)."""
        batches = [rows] if isinstance(rows, pa.RecordBatch) else rows.to_batches()
        return cls.from_fragments(execution_id, [CallFragment.from_rows(b) for b in batches if b.num_rows])

    @classmethod
    def from_events(cls, events: Sequence[ModelCallFinished]) -> "ExecutionCalls":
        """Build from validated events of one execution (tests, the proxy); seqs default to list order."""
        if not events:
            raise TrajectoryError("cannot build an execution from zero model calls")
        execution_id = events[0].execution_id
        others = {e.execution_id for e in events} - {execution_id}
        if others:
            raise TrajectoryError(f"events of executions {sorted(others)} mixed into {execution_id!r}")
        table = pa.table(
            {
                "call_id": pa.array([e.call_id for e in events], pa.string()),
                "parent_call_id": pa.array([e.parent_call_id for e in events], pa.string()),
                "branch": pa.array([e.branch for e in events], pa.string()),
                "prefix_len": pa.array([e.prefix_len for e in events], pa.int64()),
                "prompt_delta_ids": pa.array([e.prompt_delta_ids for e in events], _TOKEN_LIST),
                "output_ids": pa.array([e.output_ids for e in events], _TOKEN_LIST),
                "output_logprobs": pa.array([e.output_logprobs for e in events], _LOGPROB_LIST),
                "policy_version": pa.array([e.policy_version for e in events], pa.int64()),
                "seq": pa.array([e.seq if e.seq is not None else i for i, e in enumerate(events)], pa.int64()),
            }
        )
        return cls.from_arrow(execution_id, table)


def _ints(column: pa.ChunkedArray | pa.Array, dtype: type, fill: int = 0) -> np.ndarray:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if column.null_count:
        column = column.fill_null(fill)
    return column.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _list_parts(array: pa.ListArray, value_type: type) -> tuple[np.ndarray, np.ndarray]:
    """Offsets (int64, into the child buffer) and the child buffer itself, without copying it."""
    if array.null_count:
        array = array.fill_null(pa.scalar([], array.type))
    offsets = array.offsets.to_numpy().astype(np.int64)
    values = array.values
    if values.null_count:
        values = values.fill_null(0)
    return offsets, values.to_numpy(zero_copy_only=False).astype(value_type, copy=False)
