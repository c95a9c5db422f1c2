"""The trajectory processor: prefix-shared trees from the log, capped ranked sampling, each policy token
trained once, fair per-execution weights, GSPO group advantages, and Arrow micro-batches for the trainer.

Pipeline (pure cores, I/O at the edges)::

    LogSource (DuckDB) -> Group -> ExecutionCalls -> CallTree -> Selection -> ExecutionPlan -> MicroBatch

The trainer imports ``BatchBuilder``, ``TrajectoryConfig``, ``MicroBatch`` and the column specs
(``PACKED_COLUMNS``, ``EXPANDED_COLUMNS``, ``schema``). See ``docs/trajectory.md``.
"""

from gyre.trajectory.batches import ExecutionPlan, MicroBatch
from gyre.trajectory.builder import BatchBuilder, build
from gyre.trajectory.calls import BRANCHES, ExecutionCalls
from gyre.trajectory.config import TrajectoryConfig
from gyre.trajectory.errors import TrajectoryConfigError, TrajectoryError
from gyre.trajectory.groups import Group, Member
from gyre.trajectory.report import BuildReport
from gyre.trajectory.rewards import ExecutionOutcome, advantages
from gyre.trajectory.selection import Selection, select
from gyre.trajectory.spec import EXPANDED_COLUMNS, PACKED_COLUMNS, Column, schema
from gyre.trajectory.tree import CallTree

__all__ = [
    "BRANCHES",
    "EXPANDED_COLUMNS",
    "PACKED_COLUMNS",
    "BatchBuilder",
    "BuildReport",
    "CallTree",
    "Column",
    "ExecutionCalls",
    "ExecutionOutcome",
    "ExecutionPlan",
    "Group",
    "Member",
    "MicroBatch",
    "Selection",
    "TrajectoryConfig",
    "TrajectoryConfigError",
    "TrajectoryError",
    "advantages",
    "build",
    "schema",
    "select",
]
