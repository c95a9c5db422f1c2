"""State as projections of the log: a fold framework and the cluster, executions, trainer and run views."""

from gyre.state.cluster import Cell, ClusterState, ClusterView
from gyre.state.executions import Execution, ExecutionsState, ExecutionsView
from gyre.state.fold import (
    BatchColumns,
    Projection,
    Snapshot,
    fold,
    fold_batches,
    load_snapshot,
    on,
    replay,
    restore,
    save_snapshot,
    take_snapshot,
)
from gyre.state.run import RunState, RunView
from gyre.state.trainer import StepState, TrainerState, TrainerView

PROJECTIONS = {p.name: p for p in (ClusterView, ExecutionsView, TrainerView, RunView)}

__all__ = [
    "PROJECTIONS", "BatchColumns", "Cell", "ClusterState", "ClusterView", "Execution", "ExecutionsState",
    "ExecutionsView",
    "Projection", "RunState", "RunView", "Snapshot", "StepState", "TrainerState", "TrainerView", "fold", "fold_batches",
    "load_snapshot", "on", "replay", "restore", "save_snapshot", "take_snapshot",
]
