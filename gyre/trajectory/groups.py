"""The unit the builder works on: one GSPO group with its members' outcomes and (when needed) calls."""

from dataclasses import dataclass

import pyarrow as pa

from gyre.trajectory.calls import CallFragment, ExecutionCalls
from gyre.trajectory.errors import TrajectoryError
from gyre.trajectory.rewards import ExecutionOutcome


@dataclass(frozen=True, eq=False)
class Member:
    """One execution of a group: its outcome and, when it will be trained on, its model-call rows."""

    outcome: ExecutionOutcome
    calls: pa.Table | list[CallFragment] | ExecutionCalls | TrajectoryError | None = None
    """Rows of the ``model_calls`` view (``CALL_COLUMNS``) as a table or as fragments, already-built calls,
    the error that assembling them raised (the builder counts the member as malformed), or ``None`` if not
    loaded."""


@dataclass(frozen=True, eq=False)
class Group:
    """A GSPO group: the executions of one task sampled together (``group_id`` ``None``: never queued)."""

    group_id: str | None
    members: tuple[Member, ...]

    @property
    def pending(self) -> bool:
        """Some member is still running or awaiting evaluation, so advantages cannot be computed yet."""
        return self.group_id is not None and any(m.outcome.verdict == "pending" for m in self.members)
