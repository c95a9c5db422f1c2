"""What follows a run's log: scalar metrics, exporters (TensorBoard, Weights & Biases offline), the report.

The log is the only source: exporters read committed events (live with ``LogReader.follow`` or after the
run), never a training process's memory, so an export can be redone or run in another process.
"""

from gyre.observe.exporters import Exporter, TensorBoardExporter, WandbExporter, make_exporters
from gyre.observe.follow import LogFollower, export_log
from gyre.observe.metrics import Scalar, scalars

__all__ = [
    "Exporter",
    "LogFollower",
    "Scalar",
    "TensorBoardExporter",
    "WandbExporter",
    "export_log",
    "make_exporters",
    "scalars",
]
